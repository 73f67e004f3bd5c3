//! The response body: the inner service's, or the layer's own refusal.

use std::{
    pin::Pin,
    task::{ready, Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use futures_util::future::BoxFuture;

use crate::owner::RequestGuard;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The body of a [`LockService`](super::LockService) response: the inner service's
    /// body, or the problem document of a refusal (contention, bad input, an unavailable
    /// lock store).
    ///
    /// With [`Locks::hold_until_body_end`](crate::Locks::hold_until_body_end) it holds the
    /// request's keys until the inner body has ended, and releases them before it reports
    /// its own end; dropped early (the client left), it releases them in the background.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            guard: Option<RequestGuard>,
            release: Option<BoxFuture<'static, ()>>,
        },
        Refusal { body: axum::body::Body },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                guard: None,
                release: None,
            },
        }
    }

    pub(crate) fn holding(body: B, guard: RequestGuard) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                guard: Some(guard),
                release: None,
            },
        }
    }

    pub(crate) fn refusal(body: axum::body::Body) -> Self {
        Self {
            kind: Kind::Refusal { body },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner {
                body,
                guard,
                release,
            } => {
                if release.is_none() {
                    match ready!(body.poll_frame(cx)) {
                        Some(Ok(frame)) => return Poll::Ready(Some(Ok(frame))),
                        // The guard's drop releases the keys in the background.
                        Some(Err(error)) => {
                            guard.take();
                            return Poll::Ready(Some(Err(error.into())));
                        }
                        None => match guard.take() {
                            Some(guard) => *release = Some(guard.release()),
                            None => return Poll::Ready(None),
                        },
                    }
                }
                // The body has ended: release before saying so, as for a plain response.
                if let Some(releasing) = release {
                    ready!(releasing.as_mut().poll(cx));
                    *release = None;
                }
                Poll::Ready(None)
            }
            KindProj::Refusal { body } => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            // Not ended while keys remain to release: the release runs in `poll_frame`.
            Kind::Inner {
                body,
                guard,
                release,
            } => body.is_end_stream() && guard.is_none() && release.is_none(),
            Kind::Refusal { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // No exact size while keys remain to release: given one, hyper frames the
            // response with a Content-Length, stops polling once that many bytes are out
            // and drops the body, so the release would run in the background after the
            // client has the whole response. Without one it polls to the end, and the
            // release comes first.
            Kind::Inner {
                body,
                guard,
                release,
            } if guard.is_some() || release.is_some() => {
                let mut hint = SizeHint::new();
                hint.set_lower(body.size_hint().lower());
                hint
            }
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Refusal { body } => body.size_hint(),
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Refusal { .. } => "refusal",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}
