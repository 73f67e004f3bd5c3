//! The idempotency service: look for a stored answer, lock the key, run, store.

use std::{
    convert::Infallible,
    fmt,
    panic::AssertUnwindSafe,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{stream, FutureExt, StreamExt};
use http::{request, response, HeaderMap, Request};
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use tower_layer::Layer;
use tower_service::Service;

use super::{
    answer::{fingerprint, Answer, Fingerprint},
    config::Config,
    key, refusals,
};
use futures_util::future::{BoxFuture, Either};

use crate::{
    backoff::Backoff,
    keys::body::read_capped,
    lease::{Enclosing, Lease},
    locks::Locks,
    log_once::error_once_for,
    middleware::LockService,
    rejection::{Refused, Rejection},
    store::contract::StoredAnswer,
    unrouted,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The keys of the in-flight lock: the one in the request's [`Run`], none without one.
type InFlightKeys = fn(&request::Parts) -> Result<Vec<String>, Rejection>;

fn in_flight_keys(parts: &request::Parts) -> Result<Vec<String>, Rejection> {
    Ok(parts
        .extensions
        .get::<Run>()
        .map(|run| vec![run.lock_key.clone()])
        .unwrap_or_default())
}

/// The service that [`Idempotency`](super::Idempotency) wraps around its inner service.
///
/// Its own refusals, replays and the inner service's answers are all
/// [`axum::response::Response`]s; its inner service is an infallible one, as axum's
/// routes are (a stored answer is a response, never an error).
pub struct IdempotencyService<S> {
    /// The in-flight lock around the recorder around the inner service.
    inner: LockService<Recorder<S>, InFlightKeys>,
    shared: Arc<Shared>,
}

/// What every request of a layer needs: the store and the settings.
struct Shared {
    locks: Locks,
    config: Config,
}

/// One request with a key, on its way through the in-flight lock.
#[derive(Clone)]
struct Run {
    /// The in-flight lock's key (without the namespace).
    lock_key: String,
    /// The stored answer's key (with the namespace).
    answer_key: Arc<str>,
    fingerprint: Fingerprint,
    /// The lease of lock layers outside this one, if any, which names the request's owner.
    outer_lease: Option<Lease>,
}

impl<S> IdempotencyService<S> {
    pub(super) fn new(inner: S, locks: Locks, config: Config) -> Self {
        let shared = Arc::new(Shared { locks, config });
        let recorder = Recorder {
            inner,
            shared: shared.clone(),
        };
        let in_flight = shared.locks.layer(in_flight_keys as InFlightKeys);
        Self {
            inner: in_flight.layer(recorder),
            shared,
        }
    }
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("locks", &self.shared.locks)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = http::Response<ResBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // Made ready by `poll_ready`: that one runs this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let config = &shared.config;
            let (mut parts, body) = request.into_parts();
            let key = if unrouted::matched_no_route(&mut parts) {
                // The router's fallback answers it (see `unrouted`): nothing to keep.
                None
            } else {
                match key::read(&parts.headers, config.max_key_len) {
                    Ok(None) if config.required => return Ok(refusals::missing_key()),
                    Ok(key) => key,
                    Err(rejection) => return Ok(rejection.into_response()),
                }
            };
            let Some(key) = key else {
                // The request runs as it is, through no lock.
                let request = Request::from_parts(parts, Body::new(body));
                return Ok(inner.call(request).await?.map(Body::new));
            };
            let body = match read_capped(&parts.headers, body, config.body_limit).await {
                Ok(body) => body,
                Err(rejection) => return Ok(rejection.into_response()),
            };
            let mut run = shared.run(&parts, &body, &key);
            // The in-flight lock gets an owner of its own, never one that may enter it
            // again (an outer lock layer's, which its lease names, so the lease is taken
            // off meanwhile): two requests with one key are duplicates, whoever owns them.
            run.outer_lease = parts.extensions.remove::<Lease>();
            let outer_owner = run.outer_lease.as_ref().map(|lease| lease.owner().clone());
            // A retry of a finished request is answered without taking any lock.
            if let Some(answer) = shared.stored(&run).await {
                return Ok(answer);
            }
            parts.extensions.insert(run);
            let request = Request::from_parts(parts, Body::from(body));
            // The run goes on in a task of its own, so that it reaches its end and stores
            // its answer even when this future is dropped: a client that went away (hyper
            // then drops it) or a timeout around this layer must not leave a request that
            // did its work but stored nothing, which its retry would run again. Lock
            // layers around this one keep their keys until it ends (a run apart), and
            // one that loses its lease and cancels its inner service cancels it.
            // Counted before the task starts: the request may be dropped before then.
            let call = inner.call(request);
            let run = match outer_owner {
                Some(owner) => Either::Left(owner.run_apart(call)),
                None => Either::Right(async move { Some(call.await) }),
            };
            let response = match tokio::spawn(run).await {
                Ok(Some(response)) => response?,
                // Cancelled by a layer around this one, which answers for it.
                Ok(None) => return Ok(Rejection::unavailable().into_response()),
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                // The runtime is shutting down.
                Err(_) => return Ok(Rejection::unavailable().into_response()),
            };
            // The recorder takes the marks off its inner service's refusals: a refusal
            // here is the in-flight lock's.
            let refused = response.extensions().get::<Refused>().copied();
            if refused.is_some_and(|r| r.contended) {
                let after = response.headers().get(http::header::RETRY_AFTER).cloned();
                return Ok(refusals::in_progress(after));
            }
            Ok(response.map(Body::new))
        })
    }
}

impl Shared {
    /// The keys and the fingerprint of a request with `key`.
    fn run(&self, parts: &request::Parts, body: &[u8], key: &str) -> Run {
        let scope = self.config.scope.as_ref().map(|scope| scope(parts));
        let scope = scope.as_deref().unwrap_or_default();
        // The scope's length first: no scope and key can be cut into another pair.
        let scoped = format!("{}:{scope}:{key}", scope.len());
        let path = parts.uri.path();
        let fingerprint = match &self.config.fingerprint {
            Some(custom) => fingerprint(&parts.method, path, &[&custom(parts, body)]),
            None => {
                let query = parts.uri.query().unwrap_or_default().as_bytes();
                fingerprint(&parts.method, path, &[query, body])
            }
        };
        Run {
            answer_key: format!("{}done:{scoped}", self.locks.key_policy().prefix).into(),
            lock_key: format!("run:{scoped}"),
            fingerprint,
            outer_lease: None,
        }
    }

    /// The response to `run` from its stored answer: the replay, or 422 when the answer
    /// is another request's; or 503 when the store cannot say. `None`: no answer yet.
    async fn stored(&self, run: &Run) -> Option<Response> {
        let answers = &self.locks.store().answers;
        let loaded = tokio::time::timeout(
            self.locks.call_timeout(),
            answers.load_answer(&run.answer_key),
        )
        .await;
        // A store that fails is logged once per outage, with the locks' own calls.
        let outage = self.locks.outage();
        let bytes = match loaded {
            Ok(Ok(bytes)) => {
                outage.answered();
                bytes?
            }
            Ok(Err(error)) => {
                let why = format!("could not read a stored idempotent answer: {error}");
                outage.failed(&why, 1);
                return Some(Rejection::unavailable().into_response());
            }
            Err(_) => {
                let why = "the store did not answer a read of an idempotent answer in time";
                outage.failed(&why, 1);
                return Some(Rejection::unavailable().into_response());
            }
        };
        let Some(answer) = Answer::decode(bytes) else {
            // Not written by this version: a later one's format, or not ours at all.
            error_once_for!(
                "format",
                "a stored idempotent answer is in a format this version cannot read"
            );
            return Some(Rejection::unavailable().into_response());
        };
        if answer.fingerprint != run.fingerprint {
            tracing::debug!("an Idempotency-Key was sent again with another request");
            return Some(refusals::reused_key());
        }
        tracing::debug!(status = answer.status.as_u16(), "replaying a stored answer");
        Some(answer.replay())
    }

    /// Stores `answer` for `run`. A store that fails is tried again while the in-flight
    /// lock's lease may last (its TTL): meanwhile the lock keeps the key's retries out
    /// (409), where releasing it with no answer stored would let them run the request
    /// again. After that, the failure is logged and the response goes out anyway.
    async fn store(&self, run: &Run, answer: &Answer) {
        let stored = StoredAnswer {
            key: run.answer_key.clone(),
            bytes: answer.encode(),
            retention: self.config.retention,
        };
        let give_up_at = Instant::now() + self.locks.lease_ttl();
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let store = self.locks.store().answers.store_answer(&stored);
            let failure = match tokio::time::timeout(self.locks.call_timeout(), store).await {
                Ok(Ok(true)) => return self.locks.outage().answered(),
                Ok(Ok(false)) => return self.stored_first(run, &stored.bytes).await,
                Ok(Err(error)) => error.to_string(),
                Err(_) => "the store did not answer in time".to_owned(),
            };
            if !backoff.sleep_before(give_up_at).await {
                // One line for each request given up: its retry will run it again.
                tracing::error!(
                    failure,
                    "could not store an idempotent answer: a retry will run the request again"
                );
                return;
            }
            let why = format!("could not store an idempotent answer (retrying): {failure}");
            self.locks.outage().failed(&why, 1);
        }
    }

    /// An answer was there when this run stored its own: its own, from an attempt whose
    /// reply was lost, or another run's, whose in-flight lock lapsed while this one ran.
    async fn stored_first(&self, run: &Run, encoded: &Bytes) {
        let load = self.locks.store().answers.load_answer(&run.answer_key);
        let stored = tokio::time::timeout(self.locks.call_timeout(), load).await;
        if !matches!(stored, Ok(Ok(Some(ref stored))) if stored == encoded) {
            tracing::warn!(
                "another answer was stored for this Idempotency-Key first; it is the one replayed"
            );
        }
    }
}

/// Runs the inner service for a request that holds its key's in-flight lock, and stores
/// the answer before the lock is released.
pub(super) struct Recorder<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: Clone> Clone for Recorder<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S> fmt::Debug for Recorder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder").finish_non_exhaustive()
    }
}

impl<S, ResBody> Service<Request<Body>> for Recorder<S>
where
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let Some(run) = request.extensions().get::<Run>().cloned() else {
                return Ok(inner.call(request).await?.map(Body::new));
            };
            // The in-flight lock is this layer's own business: the request goes on with
            // the owner and the lease it came with. Lock layers inside that took the
            // in-flight lock's owner for theirs would see an owner that already holds
            // keys, which no waiter's reservation keeps out: requests with a key would
            // jump the line of fair waiting.
            // Its hold still counts in the lease the handler sees: lost with it, expiring
            // with it.
            let extensions = request.extensions_mut();
            // Its loss never cancels the request (`Locks::idempotency`), where a lock
            // layer inside would.
            let in_flight = extensions.remove::<Lease>().map(Lease::never_cancelling);
            match (run.outer_lease.clone(), in_flight) {
                (Some(outer), Some(hold)) => {
                    extensions.insert(outer.within(hold));
                }
                (Some(outer), None) => {
                    extensions.insert(outer);
                }
                (None, Some(hold)) => {
                    extensions.insert(Enclosing(hold));
                }
                (None, None) => {}
            }
            // The first request may have finished between the first look and the lock.
            if let Some(answer) = shared.stored(&run).await {
                return Ok(answer);
            }
            let response = match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
                Ok(response) => response?,
                Err(panic) => {
                    // The handler may have done part of its work: its retries get a 500
                    // that says so, not a second run. The panic goes on to whatever
                    // handles panics around this layer, as it would without it.
                    let (parts, body) = refusals::panicked().into_parts();
                    shared.keep(&run, parts, body).await;
                    std::panic::resume_unwind(panic);
                }
            };
            let (parts, body) = response.into_parts();
            Ok(shared.keep(&run, parts, body).await)
        })
    }
}

impl Shared {
    /// Stores the inner service's answer for `run` if it is one to keep, and gives the
    /// response back to send.
    async fn keep<B>(&self, run: &Run, mut parts: response::Parts, body: B) -> Response
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let refused = parts.extensions.remove::<Refused>().is_some();
        if refused || !(self.config.store_if)(&parts) {
            tracing::debug!(status = parts.status.as_u16(), "an answer not to store");
            return Response::from_parts(parts, Body::new(body));
        }
        let captured = Captured::read(Body::new(body), self.config.max_answer).await;
        let kept = match &captured {
            Captured::Whole { data, .. } => Some(Some(data.clone())),
            // Stored without its body: a retry gets neither a replay nor another run.
            Captured::TooLarge { .. } => Some(None),
            // A body that failed is not an answer: a retry runs again.
            Captured::Failed { .. } => None,
        };
        if let Some(body) = kept {
            let cookies = self.config.scope.is_some();
            let answer = Answer::of(run.fingerprint, &parts, body, cookies);
            self.store(run, &answer).await;
        }
        Response::from_parts(parts, captured.into_body())
    }
}

/// A response body as read for storing.
enum Captured {
    /// All of it.
    Whole {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// More than the limit: what was read, and the rest, still to be sent.
    TooLarge { read: Bytes, rest: Body },
    /// It failed half-way: what was read, and the error, still to be sent.
    Failed { read: Bytes, error: axum::Error },
}

impl Captured {
    /// Reads `body` up to `limit` bytes.
    async fn read(mut body: Body, limit: usize) -> Self {
        let mut data = BytesMut::new();
        if body.size_hint().lower() > limit as u64 {
            return Self::TooLarge {
                read: Bytes::new(),
                rest: body,
            };
        }
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(frame) => frame,
                Err(error) => {
                    let read = data.freeze();
                    return Self::Failed { read, error };
                }
            };
            match frame.into_data() {
                Ok(chunk) => {
                    let over = data.len() + chunk.len() > limit;
                    data.put(chunk);
                    if over {
                        let read = data.freeze();
                        return Self::TooLarge { read, rest: body };
                    }
                }
                Err(frame) => {
                    // Trailers end the body; they go out, and are not replayed.
                    let trailers = frame.into_trailers().ok();
                    let data = data.freeze();
                    return Self::Whole { data, trailers };
                }
            }
        }
        let data = data.freeze();
        Self::Whole {
            data,
            trailers: None,
        }
    }

    /// The body to send: the same frames the inner service gave.
    fn into_body(self) -> Body {
        match self {
            Self::Whole {
                data,
                trailers: None,
            } => Body::from(data),
            Self::Whole {
                data,
                trailers: Some(trailers),
            } => frames([Ok(Frame::data(data)), Ok(Frame::trailers(trailers))]),
            Self::TooLarge { read, rest } => Body::new(StreamBody::new(
                stream::once(async { Ok(Frame::data(read)) }).chain(BodyStream::new(rest)),
            )),
            Self::Failed { read, error } => frames([Ok(Frame::data(read)), Err(error)]),
        }
    }
}

fn frames<const N: usize>(frames: [Result<Frame<Bytes>, axum::Error>; N]) -> Body {
    Body::new(StreamBody::new(stream::iter(frames)))
}
