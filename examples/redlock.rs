//! Locks that outlive any minority of several independent Redis masters: the memory
//! example's routes on Redlock over the comma-separated `REDIS_URLS` (three or more).
//!
//! ```sh
//! REDIS_URLS=redis://127.0.0.1:7001/,redis://127.0.0.1:7002/,redis://127.0.0.1:7003/ \
//!   cargo run --example redlock
//! ```

use std::{env, time::Duration};

use axum::Router;
use tower_batch_lock::{store::Redlock, Locks};

/// The routes of the memory example: only the store differs.
#[path = "memory.rs"]
#[allow(dead_code, unreachable_pub)] // its `main`; `app` is this example's too
mod memory;

/// The memory example's routes, locked on a majority of the masters at `urls`.
pub fn app(urls: &[String]) -> Result<Router, tower_batch_lock::redis::RedisError> {
    // Each master may take 100 ms to answer (the default); a batch holds once a majority
    // granted it, for the TTL less the time that took and an allowance for clock drift.
    let store = Redlock::new(urls)
        .node_timeout(Duration::from_millis(200))
        .build()?;
    let locks = Locks::new(store).ttl(Duration::from_secs(10));
    Ok(memory::app(&locks))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let urls: Vec<String> = env::var("REDIS_URLS")?
        .split(',')
        .map(str::to_owned)
        .collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(&urls)?).await?;
    Ok(())
}
