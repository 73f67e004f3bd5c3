//! A retried `POST /orders` never creates a second order: the first answer to each
//! `Idempotency-Key` is stored and replayed, and the order's skus are locked while it runs.
//!
//! ```sh
//! cargo run --example idempotency
//! curl -i -X POST localhost:3000/orders -H 'idempotency-key: "k-1"' \
//!   -H 'content-type: application/json' -d '{"skus": ["a"]}'    # 201 order 1
//! # the same again: 201 order 1, with Idempotent-Replayed: true
//! ```

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use axum::{http::StatusCode, routing::post, Json, Router};
use serde::Deserialize;
use tower_batch_lock::{keys, Locks};

/// The body of `POST /orders`.
#[derive(Debug, Deserialize)]
struct NewOrder {
    skus: Vec<String>,
}

/// `POST /orders`, on `locks`; `created` counts the orders the handler made.
pub fn app(locks: &Locks, created: Arc<AtomicU64>) -> Router {
    let skus = keys::json(|order: NewOrder| order.skus.into_iter().map(|sku| format!("sku:{sku}")));
    let create = post(move |Json(order): Json<NewOrder>| async move {
        let number = created.fetch_add(1, Ordering::SeqCst) + 1;
        (
            StatusCode::CREATED,
            format!("order {number}: {} skus", order.skus.len()),
        )
    });
    // The idempotency layer outside (the later `.layer`): a retry is answered from the
    // store without taking the skus' locks, and a refusal by the lock layer (409, 503, a
    // bad body) is never stored, so the retry runs.
    Router::new().route(
        "/orders",
        create
            .layer(locks.layer(skus))
            .layer(locks.idempotency().required(true)),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(&Locks::memory(), Arc::default())).await?;
    Ok(())
}
