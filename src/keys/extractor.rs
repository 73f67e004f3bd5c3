//! The extractor contract: [`KeyExtractor`], and what key closures return ([`IntoKeys`]).

use std::future::{ready, Future, Ready};

use axum::response::{IntoResponse, Response};
use http::{request::Parts, Request};

/// What an extractor gives back: the request, for the inner service, and its keys; or the
/// response that refuses the request.
pub type Extracted<B> = Result<(Request<B>, Vec<String>), Response>;

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
}

/// What a key closure returns: the keys, as any collection or iterator of strings.
///
/// Implemented for everything that iterates over values that are `Into<String>`: a
/// `Vec<String>`, an array `[String; N]`, an `Option<String>` for one key or none, a
/// `Vec<&str>`, `ids.into_iter().map(|id| format!("sku:{id}"))`. Not for numbers, on
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
    fn into_keys(self) -> Vec<String>;
}

// Without `do_not_recommend`, the compiler would report the deepest bound that fails
// (`String: From<u64>`) instead of this trait's message, which says what to return.
#[diagnostic::do_not_recommend]
impl<I> IntoKeys for I
where
    I: IntoIterator,
    I::Item: Into<String>,
{
    fn into_keys(self) -> Vec<String> {
        self.into_iter().map(Into::into).collect()
    }
}
