//! What fair waiting costs when nobody contends: one uncontended acquire + release of a
//! batch through the layer, on the memory store and on one local `redis-server` started
//! here, for a request that does not wait, one that waits in line (fair, the default when
//! waiting) and one that waits without fairness.
//!
//! The three policies take turns round by round on the same keys, so that a slow moment of
//! the machine does not land on one of them alone. Reported per store and batch size: the
//! median of each, and the ratio fair / unfair.
//!
//! Run with `cargo bench --bench fairness` (ROUNDS=300 by default; 3,000 keys get a fifth
//! as many).

#[allow(dead_code, unused_imports)] // the tests' support: a bench uses a small part of it
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use tower_batch_lock::store::{Redis, Store};

use axum::{body::Body, routing::post, Router};
use http::{request::Parts, Request, StatusCode};
use tower::ServiceExt;
use tower_batch_lock::{Locks, Rejection, Wait};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// A router that locks `n` keys per request, for each policy.
fn routers(locks: &Locks, n: usize) -> [(&'static str, Router); 3] {
    let keys: Vec<String> = (0..n).map(|i| format!("sku:{i}")).collect();
    let wait = Duration::from_secs(1);
    let policies = [
        ("no wait", Wait::none()),
        ("fair", Wait::up_to(wait)),
        ("unfair", Wait::up_to(wait).fair(false)),
    ];
    policies.map(|(name, wait)| {
        let keys = keys.clone();
        let layer = locks
            .layer(move |_: &Parts| Ok::<_, Rejection>(keys.clone()))
            .wait(wait);
        (
            name,
            Router::new().route("/", post(|| async {}).layer(layer)),
        )
    })
}

/// Medians of `rounds` cycles per policy, taking turns.
async fn measure(locks: &Locks, n: usize, rounds: usize) -> [Duration; 3] {
    let routers = routers(locks, n);
    let mut samples: [Vec<Duration>; 3] = Default::default();
    for _ in 0..rounds {
        for ((_, app), samples) in routers.iter().zip(&mut samples) {
            let started = Instant::now();
            let response = app
                .clone()
                .oneshot(Request::post("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(
                response.status(),
                StatusCode::OK,
                "the keys are uncontended"
            );
            samples.push(started.elapsed());
        }
    }
    samples.map(median)
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(300);
    let server = support::RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let stores = [
            ("memory", Locks::new(Store::isolated_memory())),
            (
                "redis",
                Locks::new(Redis::pool(server.pool()).build().unwrap()),
            ),
        ];
        println!("uncontended acquire + release through the layer, {rounds} rounds, medians");
        println!(
            "{:>7} {:>6} {:>11} {:>11} {:>11} {:>12}",
            "store", "keys", "no wait", "fair", "unfair", "fair/unfair"
        );
        for (name, locks) in &stores {
            // Load the scripts and warm the connection.
            measure(locks, 10, 10).await;
            for (n, rounds) in [(1, rounds), (3_000, (rounds / 5).max(5))] {
                let [none, fair, unfair] = measure(locks, n, rounds).await;
                let ratio = fair.as_secs_f64() / unfair.as_secs_f64();
                println!(
                    "{name:>7} {n:>6} {none:>11.2?} {fair:>11.2?} {unfair:>11.2?} {ratio:>11.3}x"
                );
            }
        }
    });
}
