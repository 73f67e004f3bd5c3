//! The extractor contract: [`KeyExtractor`], the [`Key`]s it reads, and what key closures
//! return ([`IntoKeys`]).

use std::{
    borrow::Cow,
    future::{ready, Future, Ready},
    pin::Pin,
};

use axum::response::{IntoResponse, Response};
use http::{request::Parts, Request};

use crate::store::contract::Mode;

/// What an extractor gives back: the request, for the inner service, and its keys; or the
/// response that refuses the request.
pub type Extracted<B> = Result<(Request<B>, Vec<Key>), Response>;

/// One lock key, and how the request holds it: exclusively (the default, what a `String`
/// becomes) or [shared](Key::shared).
///
/// A request that writes some resources and only reads others names each in its mode: a
/// purchase order writes its SKUs and reads the price list, which other orders read at the
/// same time.
///
/// ```
/// use tower_batch_lock::keys::Key;
///
/// let skus = ["ab-1", "cd-2"];
/// let keys: Vec<Key> = skus
///     .iter()
///     .map(|sku| Key::from(format!("sku:{sku}")))
///     .chain([Key::shared("price-list:eu")])
///     .collect();
/// # assert_eq!(keys[2].name(), "price-list:eu");
/// ```
///
/// A key named twice in one batch is held once, exclusively if either names it so. A route
/// whose keys are all shared says so once, with
/// [`LockLayer::shared`](crate::LockLayer::shared).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    name: String,
    mode: Mode,
}

impl Key {
    /// A key held by this request alone.
    pub fn exclusive(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            mode: Mode::Exclusive,
        }
    }

    /// A key held together with other shared holders, and no exclusive one (see [`Mode`]).
    pub fn shared(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            mode: Mode::Shared,
        }
    }

    /// The key's name, without the namespace prefix.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How the request holds it.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub(crate) fn into_parts(self) -> (String, Mode) {
        (self.name, self.mode)
    }
}

// One impl per string type rather than one for `Into<String>`, which would overlap with
// `From<Key> for Key`.
impl From<String> for Key {
    fn from(name: String) -> Self {
        Self::exclusive(name)
    }
}

impl From<&str> for Key {
    fn from(name: &str) -> Self {
        Self::exclusive(name)
    }
}

impl From<&String> for Key {
    fn from(name: &String) -> Self {
        Self::exclusive(name.as_str())
    }
}

impl From<Cow<'_, str>> for Key {
    fn from(name: Cow<'_, str>) -> Self {
        Self::exclusive(name)
    }
}

impl From<Box<str>> for Key {
    fn from(name: Box<str>) -> Self {
        Self::exclusive(name)
    }
}

/// Reads the lock keys of a request.
///
/// Implemented for closures over the request head (see the [module docs](crate::keys)) and for
/// every extractor this module builds. An extractor that reads the body must put the same
/// bytes back into the request it returns.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a key extractor",
    label = "not a key extractor",
    note = "key extractors are `keys::path`, `keys::header`, `keys::query`, `keys::json`, \
            `keys::from_parts`, `keys::from_request`, `keys::all`, and closures \
            `Fn(&http::request::Parts) -> Result<impl IntoKeys, impl IntoResponse>`"
)]
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// The future that [`extract`](Self::extract) returns.
    type Future: Future<Output = Extracted<B>> + Send + 'static;

    /// Reads the keys of `request`.
    ///
    /// # Errors
    ///
    /// Returns the response to send instead of running the inner service, when the request
    /// does not say which resources it touches in a usable way: a 4xx for bad input.
    fn extract(&self, request: Request<B>) -> Self::Future;

    /// Reads the keys of `request` at once where they are in its head, or gives back the
    /// future of [`extract`](Self::extract) where they are not (or not yet). The layer
    /// calls this one: keys read at once, from a store that answers at once, lock without
    /// a future of the layer's own. The default is `extract`'s future.
    ///
    /// # Errors
    ///
    /// `extract`'s future, for the layer to await.
    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        Err(self.extract(request))
    }
}

impl<B, F, K, E> KeyExtractor<B> for F
where
    B: Send + 'static,
    F: Fn(&Parts) -> Result<K, E> + Clone + Send + Sync + 'static,
    K: IntoKeys,
    E: IntoResponse,
{
    type Future = Ready<Extracted<B>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let keys = match self(&parts) {
            Ok(keys) => keys.into_keys(),
            Err(rejection) => return ready(Err(rejection.into_response())),
        };
        ready(Ok((Request::from_parts(parts, body), keys)))
    }

    fn extract_now(&self, request: Request<B>) -> Result<Extracted<B>, Self::Future> {
        Ok(self.extract(request).into_inner())
    }
}

/// The future of an extractor that awaits something of its own (boxed).
pub(crate) type BoxedExtraction<B> = Pin<Box<dyn Future<Output = Extracted<B>> + Send>>;

/// [`KeyExtractor::extract_now`] for a boxed extraction: its first poll, which finishes
/// where what it reads is in the request's head already, or the same future, to await,
/// where it is not.
pub(crate) fn first_poll<B>(
    mut extracting: BoxedExtraction<B>,
) -> Result<Extracted<B>, BoxedExtraction<B>> {
    futures_util::FutureExt::now_or_never(&mut extracting).ok_or(extracting)
}

/// What a key closure returns: the keys, as any collection or iterator of strings (each
/// held exclusively) or of [`Key`]s.
///
/// Implemented for everything that iterates over values that are `Into<Key>`: a
/// `Vec<String>`, an array `[String; N]`, an `Option<String>` for one key or none, a
/// `Vec<&str>`, `ids.into_iter().map(|id| format!("sku:{id}"))`, a `Vec<Key>` that marks
/// some keys [shared](Key::shared). Not for numbers, on
/// purpose: a key names the kind of its resource (`account:7`), or two kinds of ids would
/// lock each other. Not for one `String` either, which Rust does not iterate: return
/// `[key]`.
#[diagnostic::on_unimplemented(
    message = "a key closure must return a collection or iterator of string keys, not `{Self}`",
    label = "this key closure returns `{Self}`",
    note = "keys are `String`s or `&str`s, each with its kind in front so that two kinds of \
            ids never lock each other: `ids.into_iter().map(|id| format!(\"account:{{id}}\"))`; \
            one key is `[key]`"
)]
pub trait IntoKeys {
    /// The keys, in any order, duplicates allowed.
    fn into_keys(self) -> Vec<Key>;
}

// Without `do_not_recommend`, the compiler would report the deepest bound that fails
// (`String: From<u64>`) instead of this trait's message, which says what to return.
#[diagnostic::do_not_recommend]
impl<I> IntoKeys for I
where
    I: IntoIterator,
    I::Item: Into<Key>,
{
    fn into_keys(self) -> Vec<Key> {
        self.into_iter().map(Into::into).collect()
    }
}
