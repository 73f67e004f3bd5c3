//! What tower sees: the [`LockLayer`], the [`LockService`] it wraps around the inner
//! service, the [`ResponseFuture`] that locks before the inner service runs and releases
//! when the response is ready, and the [`ResponseBody`] that keeps the keys until the body
//! ends where [`Locks::hold_until_body_end`](crate::Locks::hold_until_body_end) asks for
//! it. The crate root re-exports all four.

mod body;
mod future;
mod layer;
mod service;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::LockLayer;
pub use service::LockService;
