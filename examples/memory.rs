//! One process, locks in memory: `PUT /orders/{id}` locks the order, `POST /orders` locks
//! every sku of its body, and busy keys are waited for up to 300 ms before a 409.
//!
//! ```sh
//! cargo run --example memory
//! curl -X POST localhost:3000/orders -H 'content-type: application/json' -d '{"skus": ["a", "b"]}'
//! ```

use std::time::Duration;

use axum::{
    routing::{post, put},
    Json, Router,
};
use serde::Deserialize;
use tower_batch_lock::{keys, Lease, Locks, Wait};

/// The body of `POST /orders`.
#[derive(Debug, Deserialize)]
struct NewOrder {
    skus: Vec<String>,
}

/// The routes, on `locks`.
pub fn app(locks: &Locks) -> Router {
    let locks = locks.clone().wait(Wait::up_to(Duration::from_millis(300)));
    let skus = keys::json(|order: NewOrder| order.skus.into_iter().map(|sku| format!("sku:{sku}")));
    Router::new()
        .route(
            "/orders/{id}",
            put(update).layer(locks.layer(keys::path("order"))),
        )
        .route("/orders", post(create).layer(locks.layer(skus)))
}

async fn update(lease: Lease) -> String {
    format!("updated under fence {}", lease.fencing_token())
}

async fn create(lease: Lease, Json(order): Json<NewOrder>) -> String {
    format!(
        "{} skus locked under fence {}",
        order.skus.len(),
        lease.fencing_token()
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(&Locks::memory())).await?;
    Ok(())
}
