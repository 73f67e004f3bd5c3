//! Every duration setting takes anything from zero to `Duration::MAX` (a century at most,
//! as good as forever), and none panics a request: the deadlines computed from them
//! (`Instant + Duration`, milliseconds in Redis) overflowed, and panicked inside
//! `Service::call`, on the first contended request. A TTL under a millisecond and a store
//! timeout of zero are refused where they are set, as documented.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    time::Duration,
};

use axum::{routing::post, Router};
use http::{header, StatusCode};
use tower_batch_lock::{store::Store, Locks, RetryAfter, Wait};

use crate::support::{
    handlers::hold,
    http::{header_keys, post_keys, send},
};

/// A holder of key `s`, and a contender for it that arrives while it holds it; the
/// holder lets go 100 ms later. The contender's status and its `Retry-After`, if any.
async fn contend(locks: &Locks) -> (StatusCode, Option<u64>) {
    let (gate, held) = hold(locks, "s").await;
    let app = Router::new().route("/", post(|| async {}).layer(locks.layer(header_keys)));
    let contender = tokio::spawn(async move { send(&app, post_keys("/", "s")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let contender = contender.await.unwrap();
    let retry_after = contender
        .headers
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (contender.status, retry_after)
}

/// Each duration setting of [`Locks`], at zero and at `Duration::MAX`, on `store`.
async fn every_duration_setting(store: impl Fn() -> Store) {
    let fresh = || Locks::new(store());
    for (name, locks, waits) in [
        ("ttl(MAX)", fresh().ttl(Duration::MAX), false),
        (
            "store_timeout(MAX)",
            fresh().store_timeout(Duration::MAX),
            false,
        ),
        ("max_hold(MAX)", fresh().max_hold(Duration::MAX), false),
        ("max_hold(ZERO)", fresh().max_hold(Duration::ZERO), false),
        (
            "wait(up_to(ZERO))",
            fresh().wait(Wait::up_to(Duration::ZERO)),
            false,
        ),
        (
            "wait(up_to(MAX))",
            fresh().wait(Wait::up_to(Duration::MAX)),
            true,
        ),
        (
            "every one at MAX",
            fresh()
                .ttl(Duration::MAX)
                .store_timeout(Duration::MAX)
                .max_hold(Duration::MAX)
                .retry_after(RetryAfter::Fixed(Duration::MAX))
                .wait(Wait::up_to(Duration::MAX)),
            true,
        ),
    ] {
        let (status, retry_after) = contend(&locks).await;
        if waits {
            assert_eq!(status, StatusCode::OK, "{name}: the contender waited");
        } else {
            assert_eq!(status, StatusCode::CONFLICT, "{name}");
            assert!(retry_after.is_some_and(|s| s >= 1), "{name}");
        }
    }
    let (status, retry_after) =
        contend(&fresh().retry_after(RetryAfter::Fixed(Duration::MAX))).await;
    assert_eq!(status, StatusCode::CONFLICT);
    // Never later than the key's expiry (its 30 s TTL), whatever the setting says.
    assert!(
        retry_after.is_some_and(|s| (1..=30).contains(&s)),
        "{retry_after:?}"
    );
    // Refused where they are set: a TTL under the stores' millisecond, a store that may
    // take no time at all.
    for zero in [Duration::ZERO, Duration::from_micros(999)] {
        let set = catch_unwind(AssertUnwindSafe(|| fresh().ttl(zero)));
        assert!(set.is_err(), "ttl({zero:?})");
    }
    let set = catch_unwind(AssertUnwindSafe(|| fresh().store_timeout(Duration::ZERO)));
    assert!(set.is_err(), "store_timeout(ZERO)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_duration_setting_panics_a_request_in_memory() {
    every_duration_setting(Store::isolated_memory).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_duration_setting_panics_a_request_on_redis() {
    use tower_batch_lock::store::Redis;

    let server = crate::support::RedisServer::start();
    every_duration_setting(|| Redis::pool(server.pool()).build().unwrap()).await;
}

/// Redlock's own setting too: a master's bound for a call, at `Duration::MAX`.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_duration_setting_panics_a_request_on_redlock() {
    use tower_batch_lock::store::Redlock;

    let servers: Vec<_> = (0..3)
        .map(|_| crate::support::RedisServer::start())
        .collect();
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    every_duration_setting(|| {
        Redlock::new(&urls)
            .node_timeout(Duration::MAX)
            .build()
            .unwrap()
    })
    .await;
}
