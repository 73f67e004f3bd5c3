//! What re-entry costs: one acquire + release of a batch the request already holds, next
//! to the same batch fresh, on one local `redis-server` started here.
//!
//! A request locks `n` keys through the layer; its handler then runs `ROUNDS` cycles of
//! `Lease::lock` + `HeldKeys::release`, alternating between the same `n` keys (re-entry:
//! each key gains and loses a second hold of the same owner) and `n` keys nobody holds
//! (a plain acquisition). Both go through the same code: the same normalization, one
//! script round trip to acquire and one to release. Reported per batch size: the medians
//! and their ratio.
//!
//! Run with `cargo bench --bench reentrant` (ROUNDS=200 by default; 3,000 keys get a
//! fifth as many).

#[allow(dead_code, unused_imports)] // the tests' support: a bench uses a small part of it
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use tower_batch_lock::store::Redis;

use axum::{body::Body, routing::post, Router};
use http::{request::Parts, Request, StatusCode};
use tower::ServiceExt;
use tower_batch_lock::{Lease, Locks, Rejection};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Runs `rounds` alternating cycles inside a handler that holds `held`, and returns the
/// (re-entrant, plain) timings.
async fn measure(locks: &Locks, n: usize, rounds: usize) -> (Duration, Duration) {
    let held: Vec<String> = (0..n).map(|i| format!("held:{i}")).collect();
    let fresh: Vec<String> = (0..n).map(|i| format!("fresh:{i}")).collect();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = std::sync::Arc::new(std::sync::Mutex::new(Some(tx)));
    let handler = {
        let held = held.clone();
        move |lease: Lease| {
            let (held, fresh, tx) = (held.clone(), fresh.clone(), tx.clone());
            async move {
                let (mut reentrant, mut plain) = (Vec::new(), Vec::new());
                for _ in 0..rounds {
                    for (keys, samples) in [(&held, &mut reentrant), (&fresh, &mut plain)] {
                        let started = Instant::now();
                        let locked = lease.lock(keys.iter().cloned()).await.expect("uncontended");
                        locked.release().await;
                        samples.push(started.elapsed());
                    }
                }
                let _ = tx
                    .lock()
                    .unwrap()
                    .take()
                    .unwrap()
                    .send((median(reentrant), median(plain)));
            }
        }
    };
    let app = Router::new().route(
        "/",
        post(handler).layer(locks.layer(move |_: &Parts| Ok::<_, Rejection>(held.clone()))),
    );
    let response = app
        .oneshot(Request::post("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    rx.await.unwrap()
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(200);
    let server = support::RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let locks =
            Locks::new(Redis::pool(server.pool()).build().unwrap()).ttl(Duration::from_secs(60));
        // Load the scripts and warm the pool.
        measure(&locks, 10, 10).await;
        println!("acquire + release through Lease::lock, one local redis-server, {rounds} rounds");
        println!(
            "{:>6} {:>12} {:>12} {:>8}",
            "keys", "plain", "re-entrant", "ratio"
        );
        for (n, rounds) in [(1, rounds), (3_000, (rounds / 5).max(5))] {
            let (reentrant, plain) = measure(&locks, n, rounds).await;
            let ratio = reentrant.as_secs_f64() / plain.as_secs_f64();
            println!("{n:>6} {plain:>12.2?} {reentrant:>12.2?} {ratio:>7.2}x");
        }
    });
}
