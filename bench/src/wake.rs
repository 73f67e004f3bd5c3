//! How long a waiting request takes to get its keys after their holder releases them.
//!
//! Two `Locks` handles on one `redis-server` stand for two server processes: A holds a
//! key, B waits for it. Each round opens A's gate at a random moment after B started
//! waiting, and measures from then (A's handler returns, its release goes out) until B's
//! handler runs. Compared:
//!
//! - `pub/sub`: `store::Redis::url`: B wakes on A's release through Redis pub/sub;
//! - `backoff`: `store::Redis::pool`: B knows nothing of A's release and retries on its
//!   jittered 5-100 ms backoff;
//! - `client retries every 50 ms`: what peer libraries leave to their users: refuse at
//!   once, and the client asks again 50 ms later.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tower_batch_lock::store::Redis;

use axum::{body::Body, routing::post, Router};
use http::{request::Parts, Request, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_batch_lock::{Locks, Rejection, Wait};

use crate::{
    progress,
    stats::{self, human, Summary},
    support::RedisServer,
};

/// Every round's wait is bounded, and so is every configuration.
const WAIT_BOUND: Duration = Duration::from_secs(5);

fn key(_: &Parts) -> Result<[&'static str; 1], Rejection> {
    Ok(["bench:wake"])
}

fn request() -> Request<Body> {
    Request::post("/").body(Body::empty()).unwrap()
}

/// A's route: says when it holds the key, and holds it until the gate opens.
fn holder(locks: &Locks, holding: Arc<Notify>, gate: Arc<Notify>) -> Router {
    let handler = post(move || {
        let (holding, gate) = (holding.clone(), gate.clone());
        async move {
            holding.notify_one();
            gate.notified().await
        }
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

async fn round(a: &Locks, b: &Locks, retry: Retry) -> Result<Duration, String> {
    let (gate, has_key) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let holding = tokio::spawn(holder(a, has_key.clone(), gate.clone()).oneshot(request()));
    // B starts once A holds the key (a busy machine may take a while to get there).
    if tokio::time::timeout(WAIT_BOUND, has_key.notified())
        .await
        .is_err()
    {
        return Err("the holder did not get the key".to_owned());
    }

    let granted = Arc::new(Mutex::new(None));
    let app = waiter(b, granted.clone());
    let waiting = tokio::spawn(async move {
        let deadline = Instant::now() + WAIT_BOUND;
        while Instant::now() < deadline {
            let status = app.clone().oneshot(request()).await.unwrap().status();
            match (retry, status) {
                (_, StatusCode::OK) => return true,
                (Retry::Client(pause), StatusCode::CONFLICT) => tokio::time::sleep(pause).await,
                _ => return false,
            }
        }
        false
    });
    // Release at a random point of the waiter's retry cycle.
    tokio::time::sleep(Duration::from_millis(10 + fastrand::u64(0..50))).await;
    let released = Instant::now();
    gate.notify_one();
    let held = holding.await.map_err(|e| e.to_string())?.unwrap();
    if held.status() != StatusCode::OK {
        return Err(format!("the holder got {}", held.status()));
    }
    match tokio::time::timeout(WAIT_BOUND * 2, waiting).await {
        Ok(Ok(true)) => {}
        _ => return Err("the waiter was not granted".to_owned()),
    }
    let granted = granted.lock().unwrap().take().ok_or("no grant noted")?;
    Ok(granted.saturating_duration_since(released))
}

pub(crate) async fn run(server: &RedisServer, quick: bool) -> Result<Value, String> {
    let (rounds, time) = if quick {
        (10, Duration::from_secs(2))
    } else {
        (200, Duration::from_secs(20))
    };
    let wait = Wait::up_to(WAIT_BOUND);
    let url = server.url();
    let redis_url = |url: &str| {
        Redis::url(url)
            .build()
            .map(Locks::new)
            .map_err(|e| e.to_string())
    };
    let configurations = [
        (
            "pub/sub (store::Redis::url)",
            redis_url(&url)?,
            redis_url(&url)?.wait(wait),
            Retry::InLayer,
        ),
        (
            "backoff (store::Redis::pool)",
            Locks::new(Redis::pool(server.pool()).build().unwrap()),
            Locks::new(Redis::pool(server.pool()).build().unwrap()).wait(wait),
            Retry::InLayer,
        ),
        (
            "client retries every 50 ms",
            Locks::new(Redis::pool(server.pool()).build().unwrap()),
            Locks::new(Redis::pool(server.pool()).build().unwrap()),
            Retry::Client(Duration::from_millis(50)),
        ),
    ];
    // Let the subscriptions of `store::Redis::url` open.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let total = configurations.len();
    let mut cases = Vec::new();
    for (index, (name, a, b, retry)) in configurations.into_iter().enumerate() {
        progress::begin(
            format!("wake {}/{total} {name}", index + 1),
            "rounds",
            rounds,
        );
        let budget = stats::Budget {
            min: 5,
            max: rounds,
            time,
        };
        let samples = stats::rounds(budget, |_| round(&a, &b, retry))
            .await
            .map_err(|error| format!("{name}: {error}"))?;
        let summary = Summary::of(samples);
        progress::end(&format!(
            "median {}, p99 {}",
            human(summary.median),
            human(summary.p99)
        ));
        let mut case = json!({ "waiter": name });
        if let (Value::Object(case), Value::Object(summary)) = (&mut case, summary.to_json()) {
            case.extend(summary);
        }
        cases.push(case);
    }
    Ok(json!({
        "method": "two Locks handles on one redis-server stand for two processes: A holds a key, B waits; A releases at a random moment 10-60 ms after B started waiting; measured from A's release until B's handler runs",
        "cases": cases,
        "targets": [],
    }))
}
