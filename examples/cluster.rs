//! Locks on a Redis Cluster, given by any of its nodes in the comma-separated
//! `REDIS_CLUSTER_URLS`: each batch is grouped by the master of its keys' slots, one call
//! per master, all at once.
//!
//! ```sh
//! REDIS_CLUSTER_URLS=redis://127.0.0.1:7000/ cargo run --example cluster --features cluster
//! ```

use std::{env, time::Duration};

use axum::Router;
use tower_batch_lock::{store::RedisCluster, Locks};

/// The routes of the memory example: only the store differs.
#[path = "memory.rs"]
#[allow(dead_code, unreachable_pub)] // its `main`; `app` is this example's too
mod memory;

/// The memory example's routes, locked on the cluster that `urls` lead to.
pub fn app(urls: &[String]) -> Result<Router, tower_batch_lock::redis::RedisError> {
    let store = RedisCluster::new(urls)
        // While the cluster moves (a failover, a slot migrating), keep trying for this
        // long before answering 503.
        .retry_for(Duration::from_millis(800))
        .build()?;
    Ok(memory::app(&Locks::new(store).ttl(Duration::from_secs(10))))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let urls: Vec<String> = env::var("REDIS_CLUSTER_URLS")?
        .split(',')
        .map(str::to_owned)
        .collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(&urls)?).await?;
    Ok(())
}
