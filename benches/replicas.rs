//! What replica acknowledgement costs: one acquire + release cycle through the layer on a
//! Redis master with one replica, with `Redis::replicas(1, ..)` (each grant waits for the
//! replica's `WAIT` acknowledgement) and without, taking turns round by round.
//!
//! Starts its own `redis-server` master and replica on free loopback ports. Reported, for a
//! batch of one key and one of 1,000: the median and p90 of each, and the median of the
//! rounds' own ratios (steadier on a busy machine).
//!
//! Run with `cargo bench --bench replicas` (ROUNDS=300 by default).

#[allow(dead_code, unused_imports)] // the tests' support: a bench uses a small part of it
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use axum::Router;
use http::StatusCode;
use support::http::{batch, batch_router};
use tower::ServiceExt;
use tower_batch_lock::{store::Redis, Locks};

const WARM_UP: usize = 20;

/// One acquire + release cycle through the layer (the release runs before the response
/// future completes), and its status.
async fn cycle(app: &Router, keys: &[String]) -> (Duration, StatusCode) {
    let started = Instant::now();
    let response = app.clone().oneshot(batch(keys)).await.unwrap();
    (started.elapsed(), response.status())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn p90(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() * 9 / 10]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(300);
    let master = support::RedisServer::start();
    let _replica = support::RedisServer::start_replica_of(&master);
    let handler = || async {};
    let plain = batch_router(
        &Locks::new(Redis::url(master.url()).build().unwrap()),
        handler,
    );
    let store = Redis::url(master.url())
        .replicas(1, Duration::from_millis(500))
        .build()
        .unwrap();
    let acknowledged = batch_router(&Locks::new(store), handler);

    println!("| batch | without | with replicas(1) | ratio of medians | median of ratios |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for size in [1, 1_000] {
        let keys: Vec<String> = (0..size).map(|i| format!("sku:{i}")).collect();
        for _ in 0..WARM_UP {
            cycle(&plain, &keys).await;
            cycle(&acknowledged, &keys).await;
        }
        let (mut without, mut with, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (a, a_status) = cycle(&plain, &keys).await;
            let (b, b_status) = cycle(&acknowledged, &keys).await;
            assert_eq!((a_status, b_status), (StatusCode::OK, StatusCode::OK));
            let (a, b) = (a.as_secs_f64() * 1e6, b.as_secs_f64() * 1e6);
            without.push(a);
            with.push(b);
            ratios.push(b / a);
        }
        let (m_without, m_with) = (median(without.clone()), median(with.clone()));
        println!(
            "| {size} | {:.0} µs (p90 {:.0}) | {:.0} µs (p90 {:.0}) | {:.2}x | {:.2}x |",
            m_without,
            p90(without),
            m_with,
            p90(with),
            m_with / m_without,
            median(ratios),
        );
    }
}
