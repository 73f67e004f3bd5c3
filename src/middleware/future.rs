//! The response future: lock, run the inner service, release.

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;
use tracing::Span;

use futures_util::future::BoxFuture;

use super::body::ResponseBody;
use crate::{
    owner::RequestGuard,
    request::{Holding, Locked},
};

pin_project! {
    /// The future of [`LockService`](super::LockService).
    ///
    /// Dropping it at any point releases whatever it holds: a client that goes away, a
    /// timeout around it or a panic inside the inner service leaves no lock behind. But
    /// for a run of the inner service that goes on apart (an idempotency layer's, inside,
    /// which finishes a request whose client left): the keys are released when it ends.
    pub struct ResponseFuture<S, B, ResBody>
    where
        S: Service<Request<B>, Response = Response<ResBody>>,
    {
        #[pin]
        state: State<S, B, ResBody>,
        span: Span,
    }

    impl<S, B, ResBody> PinnedDrop for ResponseFuture<S, B, ResBody>
    where
        S: Service<Request<B>, Response = Response<ResBody>>,
    {
        fn drop(this: Pin<&mut Self>) {
            // Dropped while the inner service runs (the client left): a run of it that goes
            // on apart (an idempotency layer's, inside) keeps the keys until it ends.
            if let StateProj::Running { guard, lost, .. } = this.project().state.project() {
                if let Some(guard) = guard.take() {
                    guard.release_after_runs_apart(lost.take());
                }
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, ResBody>
    where
        S: Service<Request<B>, Response = Response<ResBody>>,
    {
        // Extracting and acquiring the keys; `inner` is the ready service to call then.
        Locking {
            locking: BoxFuture<'static, Locked<B>>,
            inner: Option<S>,
        },
        // The inner service runs while `guard` holds the keys; `lost` resolves when the
        // lease is lost and that cancels the inner service.
        Running {
            #[pin]
            future: S::Future,
            guard: Option<RequestGuard>,
            lost: Option<BoxFuture<'static, axum::response::Response>>,
            until_body_end: bool,
            // When the guard's renewal must start, if the inner service still runs.
            renew_at: RenewAt,
        },
        // The response is ready and waits for the release, so that a client's next
        // request never finds the keys of its previous one still held.
        Releasing {
            release: BoxFuture<'static, ()>,
            output: Option<Result<Response<ResponseBody<ResBody>>, S::Error>>,
        },
        // The response was ready before the first poll: the layer refused the request.
        Refused {
            output: Option<Response<ResponseBody<ResBody>>>,
        },
    }
}

impl<S, B, ResBody> ResponseFuture<S, B, ResBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    /// The future of a request whose locking is decided already: `inner` (made ready) is
    /// called now with the request `locked` gives, or the refusal is kept.
    pub(crate) fn start(locked: Locked<B>, inner: &mut S, span: Span) -> Self {
        let state = span.in_scope(|| State::start(locked, inner));
        Self { state, span }
    }

    /// The future of a request whose locking goes on in `locking`, and which `inner` (made
    /// ready) serves once it holds its keys.
    pub(crate) fn later(locking: BoxFuture<'static, Locked<B>>, inner: S, span: Span) -> Self {
        let state = State::Locking {
            locking,
            inner: Some(inner),
        };
        Self { state, span }
    }
}

impl<S, B, ResBody> State<S, B, ResBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    /// Calls `inner` with the request that `locked` gives, or keeps the response that
    /// refuses it.
    fn start(locked: Locked<B>, inner: &mut S) -> Self {
        let (request, holding) = match locked {
            Ok(locked) => locked,
            Err(refusal) => {
                let output = Some(refusal.map(ResponseBody::refusal));
                return Self::Refused { output };
            }
        };
        let future = inner.call(request);
        // A request that named no keys holds nothing: no guard, no lease to lose.
        let (guard, lost, until_body_end, renew_at) = match holding {
            Some(Holding {
                guard,
                cancel_on_loss,
                until_body_end,
                renew_at,
            }) => (Some(guard), cancel_on_loss, until_body_end, renew_at),
            None => (None, None, false, None),
        };
        Self::Running {
            future,
            guard,
            lost,
            until_body_end,
            renew_at: renew_at.map_or(RenewAt::Never, RenewAt::Due),
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B, ResBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                StateProj::Locking { locking, inner } => {
                    let locked = ready!(locking.as_mut().poll(cx));
                    let mut inner = inner.take().expect("future polled after completion");
                    this.state.set(State::start(locked, &mut inner));
                }
                StateProj::Running {
                    future,
                    guard,
                    lost,
                    until_body_end,
                    renew_at,
                } => {
                    if let RenewAt::Armed(timer) = renew_at {
                        if timer.as_mut().poll(cx).is_ready() {
                            *renew_at = RenewAt::Never;
                            if let Some(guard) = guard.as_mut() {
                                guard.start_deferred_renewal();
                            }
                        }
                    }
                    if let Some(Poll::Ready(refusal)) =
                        lost.as_mut().map(|lost| lost.as_mut().poll(cx))
                    {
                        let output = Some(Ok(refusal.map(ResponseBody::refusal)));
                        let release = guard.take().map_or_else(no_release, RequestGuard::cancel);
                        // Dropping the inner future here is the cancellation (and
                        // `cancel` cancels its runs apart).
                        this.state.set(State::Releasing { release, output });
                        continue;
                    }
                    let Poll::Ready(output) = future.poll(cx) else {
                        // Still running: the renewal's timer is armed now, not before. Most
                        // inner services answer on their first poll and never need one.
                        if let RenewAt::Due(at) = *renew_at {
                            let mut timer = Box::pin(tokio::time::sleep_until(at.into()));
                            if timer.as_mut().poll(cx).is_ready() {
                                *renew_at = RenewAt::Never;
                                if let Some(guard) = guard.as_mut() {
                                    guard.start_deferred_renewal();
                                }
                            } else {
                                *renew_at = RenewAt::Armed(timer);
                            }
                        }
                        return Poll::Pending;
                    };
                    let Some(guard) = guard.take() else {
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                    };
                    // Answered while a run of the inner service goes on apart (a timeout
                    // between this layer and an idempotency layer answered for it): the
                    // keys stay until that run ends, and the answer goes out now.
                    if guard.runs_apart() {
                        guard.release_after_runs_apart(lost.take());
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                    }
                    match output {
                        // The body takes the guard and releases it when it ends; the
                        // renewal runs meanwhile (a body may stream for long).
                        Ok(response) if *until_body_end => {
                            let mut guard = guard;
                            guard.start_deferred_renewal();
                            return Poll::Ready(Ok(
                                response.map(|body| ResponseBody::holding(body, guard))
                            ));
                        }
                        output => {
                            let output = output.map(|r| r.map(ResponseBody::inner));
                            let mut guard = guard;
                            if guard.release_now() {
                                return Poll::Ready(output);
                            }
                            this.state.set(State::Releasing {
                                release: guard.release(),
                                output: Some(output),
                            });
                        }
                    }
                }
                StateProj::Releasing { release, output } => {
                    ready!(release.as_mut().poll(cx));
                    return Poll::Ready(output.take().expect("future polled after completion"));
                }
                StateProj::Refused { output } => {
                    let refusal = output.take().expect("future polled after completion");
                    return Poll::Ready(Ok(refusal));
                }
            }
        }
    }
}

/// When a held request's renewal must start.
enum RenewAt {
    /// It never does: no renewal, or it has started.
    Never,
    /// At this instant, if the inner service still runs then; no timer yet.
    Due(std::time::Instant),
    /// The timer, armed once the inner service did not answer at once.
    Armed(Pin<Box<Sleep>>),
}

fn no_release() -> BoxFuture<'static, ()> {
    Box::pin(std::future::ready(()))
}

impl<S, B, ResBody> std::fmt::Debug for ResponseFuture<S, B, ResBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
