//! What Redlock costs: the time of one acquire + release cycle through the layer, on three
//! local masters next to one local Redis.
//!
//! Starts four `redis-server` processes of its own on free loopback ports: three masters
//! for `Locks::redlock` and one for `Locks::redis_url`. Each round sends one request per
//! store, back to back so that both see the same machine, to a route whose handler returns
//! at once: the layer reads the keys from a JSON array, acquires them, runs the handler and
//! releases them before the response is complete. Reported, for a batch of one key and one
//! of 3,000: median and p90 of each, the ratio of the medians, and the median of the
//! rounds' own ratios (steadier on a busy machine).
//!
//! The first line is the floor on this machine: one `PING` against a majority (two) of
//! three `PING`s sent at once, on the same connections pools. No fan-out beats its ratio.
//!
//! Run with `cargo bench --bench redlock` (ROUNDS=300 by default; the 3,000-key batch gets
//! a third as many).

#[allow(dead_code, unused_imports)] // the tests' support: a bench uses a small part of it
#[path = "../tests/it/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use tower_batch_lock::store::{Redis, Redlock};

use axum::{body::Body, routing::post, Router};
use bytes::Bytes;
use futures_util::{stream::FuturesUnordered, StreamExt};
use http::{header, Request, StatusCode};
use tower::ServiceExt;
use tower_batch_lock::{keys, Locks};

const WARM_UP: usize = 20;

fn router(locks: &Locks) -> Router {
    Router::new().route(
        "/batch",
        post(|| async {}).layer(locks.layer(keys::json(|keys: Vec<String>| keys))),
    )
}

fn request(body: &Bytes) -> Request<Body> {
    Request::post("/batch")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.clone()))
        .unwrap()
}

/// One acquire + release cycle through the layer, and its status.
async fn cycle(app: &Router, body: &Bytes) -> (Duration, StatusCode) {
    let started = Instant::now();
    let response = app.clone().oneshot(request(body)).await.unwrap();
    let status = response.status();
    // The release runs before the response future completes; the body is empty.
    axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (started.elapsed(), status)
}

fn percentile<T: Copy>(sorted: &[T], p: f64) -> T {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

struct Row {
    one: Vec<Duration>,
    three: Vec<Duration>,
    ratios: Vec<f64>,
}

impl Row {
    fn new() -> Self {
        Self {
            one: Vec::new(),
            three: Vec::new(),
            ratios: Vec::new(),
        }
    }

    fn push(&mut self, one: Duration, three: Duration) {
        self.one.push(one);
        self.three.push(three);
        self.ratios.push(three.as_secs_f64() / one.as_secs_f64());
    }

    fn print(mut self, label: &str) {
        self.one.sort();
        self.three.sort();
        self.ratios.sort_by(f64::total_cmp);
        let (one, three) = (percentile(&self.one, 0.5), percentile(&self.three, 0.5));
        println!(
            "{label:<12} {one:>11.2?} {:>11.2?} {three:>12.2?} {:>12.2?} {:>7.2}x {:>7.2}x",
            percentile(&self.one, 0.9),
            percentile(&self.three, 0.9),
            three.as_secs_f64() / one.as_secs_f64(),
            percentile(&self.ratios, 0.5),
        );
    }
}

async fn compare(label: &str, keys: usize, rounds: usize, single: &Router, redlock: &Router) {
    let body = Bytes::from(
        serde_json::to_vec(&(0..keys).map(|i| format!("sku:{i}")).collect::<Vec<_>>()).unwrap(),
    );
    for _ in 0..WARM_UP {
        cycle(single, &body).await;
        cycle(redlock, &body).await;
    }
    let mut row = Row::new();
    let mut refused = 0;
    for _ in 0..rounds {
        let (one, one_status) = cycle(single, &body).await;
        let (three, three_status) = cycle(redlock, &body).await;
        if one_status != StatusCode::OK || three_status != StatusCode::OK {
            refused += 1;
            eprintln!("{label}: a cycle was refused: single {one_status}, redlock {three_status}");
            continue;
        }
        row.push(one, three);
    }
    row.print(label);
    assert!(
        refused * 20 <= rounds,
        "{refused} of {rounds} cycles were refused"
    );
}

/// One `PING` against two of three sent at once: the round-trip floor of a majority.
async fn floor(rounds: usize, single: &deadpool_redis::Pool, masters: &[deadpool_redis::Pool]) {
    async fn ping(pool: deadpool_redis::Pool) {
        let mut connection = pool.get().await.unwrap();
        let _: String = redis::cmd("PING")
            .query_async(&mut connection)
            .await
            .unwrap();
    }
    let mut row = Row::new();
    for round in 0..WARM_UP + rounds {
        let started = Instant::now();
        ping(single.clone()).await;
        let one = started.elapsed();
        let started = Instant::now();
        let mut pings: FuturesUnordered<_> = masters.iter().cloned().map(ping).collect();
        pings.next().await;
        pings.next().await;
        let majority = started.elapsed();
        tokio::spawn(async move { while pings.next().await.is_some() {} });
        if round >= WARM_UP {
            row.push(one, majority);
        }
    }
    row.print("floor: PING");
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(300);
    let single_server = support::RedisServer::start();
    let masters: Vec<_> = (0..3).map(|_| support::RedisServer::start()).collect();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ttl = Duration::from_secs(30);
        let single = router(&Locks::new(Redis::url(single_server.url()).build().unwrap()).ttl(ttl));
        let urls: Vec<String> = masters.iter().map(support::RedisServer::url).collect();
        let redlock = router(&Locks::new(Redlock::new(&urls).build().unwrap()).ttl(ttl));
        println!(
            "acquire + release through the layer, local redis-servers, {} cores, {rounds} rounds \
             (3,000 keys: {})",
            std::thread::available_parallelism().map_or(0, usize::from),
            rounds.div_ceil(3)
        );
        println!(
            "{:<12} {:>11} {:>11} {:>12} {:>12} {:>8} {:>8}",
            "batch", "single p50", "single p90", "redlock p50", "redlock p90", "ratio", "paired"
        );
        let pools: Vec<_> = masters.iter().map(support::RedisServer::pool).collect();
        floor(rounds, &single_server.pool(), &pools).await;
        compare("1 key", 1, rounds, &single, &redlock).await;
        compare("3,000 keys", 3_000, rounds.div_ceil(3), &single, &redlock).await;
    });
}
