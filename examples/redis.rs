//! Many processes, one Redis: the memory example's routes, with the locks in the Redis at
//! `REDIS_URL`. Run it twice on two ports: a batch locked by one is busy for the other.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6380/ ADDR=127.0.0.1:3000 cargo run --example redis
//! ```

use std::{env, time::Duration};

use axum::Router;
use tower_batch_lock::{store::Redis, Locks};

/// The routes of the memory example: only the store differs.
#[path = "memory.rs"]
#[allow(dead_code, unreachable_pub)] // its `main`; `app` is this example's too
mod memory;

/// The memory example's routes, on the Redis at `url`: a pool of its own, and a
/// subscription that wakes waiting requests when any process releases their keys.
pub fn app(url: &str) -> Result<Router, tower_batch_lock::redis::RedisError> {
    let locks = Locks::new(Redis::url(url).build()?)
        .ttl(Duration::from_secs(10))
        .store_timeout(Duration::from_millis(500));
    Ok(memory::app(&locks))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".to_owned());
    let app = app(&url)?;
    let addr = env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
