//! The response future: lock, run the inner service, release.

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::Span;

use crate::{backend::BoxFuture, guard::LockGuard, locks::Locked, ResponseBody};

pin_project! {
    /// The future of [`LockService`](crate::LockService).
    ///
    /// Dropping it at any point releases whatever it holds: a client that goes away, a
    /// timeout around it or a panic inside the inner service leaves no lock behind.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        span: Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        // Extracting and acquiring the keys; `inner` is the ready service to call then.
        Locking {
            locking: BoxFuture<'static, Locked<B>>,
            inner: Option<S>,
        },
        // The inner service runs while `guard` holds the keys.
        Running {
            #[pin]
            future: S::Future,
            guard: Option<LockGuard>,
        },
        // The response is ready and waits for the release, so that a client's next
        // request never finds the keys of its previous one still held.
        Releasing {
            release: BoxFuture<'static, ()>,
            output: Option<Result<S::Response, S::Error>>,
        },
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(locking: BoxFuture<'static, Locked<B>>, inner: S, span: Span) -> Self {
        Self {
            state: State::Locking {
                locking,
                inner: Some(inner),
            },
            span,
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                StateProj::Locking { locking, inner } => match ready!(locking.as_mut().poll(cx)) {
                    Ok((request, guard)) => {
                        let mut inner = inner.take().expect("future polled after completion");
                        let future = inner.call(request);
                        this.state.set(State::Running { future, guard });
                    }
                    Err(refusal) => return Poll::Ready(Ok(refusal.map(ResponseBody::refusal))),
                },
                StateProj::Running { future, guard } => {
                    let output = ready!(future.poll(cx));
                    let Some(guard) = guard.take() else {
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                    };
                    this.state.set(State::Releasing {
                        release: guard.release(),
                        output: Some(output),
                    });
                }
                StateProj::Releasing { release, output } => {
                    ready!(release.as_mut().poll(cx));
                    let output = output.take().expect("future polled after completion");
                    return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                }
            }
        }
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
