//! Idempotent requests: the first answer to each `Idempotency-Key` is stored, and replayed
//! to every retry.
//!
//! [`Locks::idempotency`](crate::Locks::idempotency) builds the layer on a lock store; see
//! [`Idempotency`].

mod answer;
mod config;
mod key;
mod layer;
mod refusals;
mod service;

pub use layer::Idempotency;
pub use service::IdempotencyService;
