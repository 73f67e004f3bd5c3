//! How long a waiting request takes to get its keys after their holder releases them.
//!
//! Two `Locks` handles on one `redis-server` (started here, on a free loopback port) stand
//! for two server processes: A holds a key, B waits for it. Each round opens A's gate at a
//! random moment after B started waiting, and measures from then (A's handler returns,
//! its release goes out) until B's handler runs. Compared:
//!
//! - `pubsub`: `Locks::redis_url`: B wakes on A's release through Redis pub/sub;
//! - `backoff`: `Locks::redis(pool)`: B knows nothing of A's release and retries on its
//!   jittered 5-100 ms backoff;
//! - `fixed 50 ms`: what peer libraries do: refuse at once, and the client retries every
//!   50 ms.
//!
//! Run with `cargo bench --bench release_to_grant` (ROUNDS=200 by default).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{body::Body, routing::post, Router};
use http::{request::Parts, Request, StatusCode};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_batch_lock::{Locks, Rejection, Wait};

/// Every round's wait is bounded, and so is every configuration.
const WAIT_BOUND: Duration = Duration::from_secs(5);
const TIME_LIMIT: Duration = Duration::from_secs(60);

fn key(_: &Parts) -> Result<[&'static str; 1], Rejection> {
    Ok(["bench:key"])
}

fn request() -> Request<Body> {
    Request::post("/").body(Body::empty()).unwrap()
}

/// A's route: holds the key until the gate opens.
fn holder(locks: &Locks, gate: Arc<Notify>) -> Router {
    let handler = post(move || {
        let gate = gate.clone();
        async move { gate.notified().await }
    });
    Router::new().route("/", handler.layer(locks.layer(key)))
}

/// B's route: notes when it got the key.
fn waiter(locks: &Locks, granted: Arc<Mutex<Option<Instant>>>) -> Router {
    let handler = post(move || {
        let granted = granted.clone();
        async move { *granted.lock().unwrap() = Some(Instant::now()) }
    });
    Router::new().route("/", handler.layer(locks.layer(key)))
}

#[derive(Clone, Copy)]
enum Retry {
    /// The layer waits (`Wait::up_to`).
    InLayer,
    /// The layer refuses at once; the client sleeps this long and asks again.
    Client(Duration),
}

async fn measure(name: &str, a: Locks, b: Locks, retry: Retry, rounds: usize) -> Vec<Duration> {
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(rounds);
    for round in 0..rounds {
        if started.elapsed() > TIME_LIMIT {
            eprintln!("{name}: time limit reached after {round} rounds");
            break;
        }
        let gate = Arc::new(Notify::new());
        let holding = tokio::spawn(holder(&a, gate.clone()).oneshot(request()));
        // Let A take the key.
        tokio::time::sleep(Duration::from_millis(2)).await;

        let granted = Arc::new(Mutex::new(None));
        let app = waiter(&b, granted.clone());
        let waiting = tokio::spawn(async move {
            loop {
                let status = app.clone().oneshot(request()).await.unwrap().status();
                match (retry, status) {
                    (_, StatusCode::OK) => return true,
                    (Retry::Client(pause), StatusCode::CONFLICT) => tokio::time::sleep(pause).await,
                    _ => return false,
                }
            }
        });
        // Release at a random point of the waiter's retry cycle.
        tokio::time::sleep(Duration::from_millis(10 + fastrand::u64(0..50))).await;
        let released = Instant::now();
        gate.notify_one();
        holding.await.unwrap().unwrap();
        let ok = tokio::time::timeout(WAIT_BOUND * 2, waiting).await;
        assert!(
            matches!(ok, Ok(Ok(true))),
            "{name}: round {round}: the waiter was not granted"
        );
        let granted = granted.lock().unwrap().take().expect("granted");
        latencies.push(granted.saturating_duration_since(released));
    }
    latencies
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(200);
    let server = support::RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let wait = Wait::up_to(WAIT_BOUND);
        let url = server.url();
        let configurations = [
            (
                "pubsub",
                Locks::redis_url(&url).unwrap(),
                Locks::redis_url(&url).unwrap().wait(wait),
                Retry::InLayer,
            ),
            ("backoff", Locks::redis(server.pool()), Locks::redis(server.pool()).wait(wait), Retry::InLayer),
            (
                "fixed 50 ms",
                Locks::redis(server.pool()),
                Locks::redis(server.pool()),
                Retry::Client(Duration::from_millis(50)),
            ),
        ];
        println!("release-to-grant latency, {rounds} rounds, two Locks handles on one local redis-server");
        println!("{:<12} {:>10} {:>10} {:>10}", "waiter", "median", "p99", "mean");
        let mut medians = Vec::new();
        for (name, a, b, retry) in configurations {
            let mut latencies = measure(name, a, b, retry, rounds).await;
            latencies.sort();
            let mean = latencies.iter().sum::<Duration>() / latencies.len() as u32;
            let (median, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
            println!("{name:<12} {median:>10.2?} {p99:>10.2?} {mean:>10.2?}");
            medians.push((name, median));
        }
        let pubsub = medians[0].1.as_secs_f64();
        for (name, median) in &medians[1..] {
            println!("median {name} / pubsub: {:.1}x", median.as_secs_f64() / pubsub);
        }
    });
}
