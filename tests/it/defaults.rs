//! Safe defaults and the first hour (issue 12): a slow handler keeps its keys without any
//! setting, `Retry-After` fits how long holds last, `Locks::check` tells whether the store
//! can serve, and a layer can override the TTL and the contention status.

use std::time::{Duration, Instant};
use tower_batch_lock::store::{Redis, Store};

use axum::{routing::post, Router};
use http::StatusCode;
use tower_batch_lock::{store::Redlock, Locks, RetryAfter};

use crate::support::{
    handlers::{gated_handler, Gate},
    http::{header_keys, post_keys, send},
    Observer, RedisServer,
};

/// A route `POST /` that locks the `x-keys` header's keys and works for `work`.
fn slow_router(locks: &Locks, work: Duration) -> Router {
    Router::new().route(
        "/",
        post(move || async move { tokio::time::sleep(work).await }).layer(locks.layer(header_keys)),
    )
}

// ---------------------------------------------------------------------------------------
// 1. A handler slower than the TTL keeps its keys, by default
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_the_ttl_keeps_its_keys_by_default() {
    let server = RedisServer::start();
    let ttl = Duration::from_millis(300);
    let stores = [
        ("memory", Locks::new(Store::isolated_memory())),
        (
            "redis",
            Locks::new(Redis::pool(server.pool()).build().unwrap()),
        ),
    ];
    for (name, locks) in stores {
        let locks = locks.ttl(ttl);
        let slow = slow_router(&locks, ttl * 3);
        let first = tokio::spawn(async move { send(&slow, post_keys("/", "acct:1")).await });
        // Past the TTL, while the first handler still runs.
        tokio::time::sleep(ttl * 2).await;
        let second = send(
            &slow_router(&locks, Duration::ZERO),
            post_keys("/", "acct:1"),
        )
        .await;
        assert_eq!(
            second.status,
            StatusCode::CONFLICT,
            "{name}: a second request ran beside a first one that outlived its TTL"
        );
        assert_eq!(first.await.unwrap().status, StatusCode::OK);

        // Without renewal, the TTL is the longest hold: what the default now prevents.
        let unrenewed = locks.clone().renew_lease(false);
        let slow = slow_router(&unrenewed, ttl * 3);
        let first = tokio::spawn(async move { send(&slow, post_keys("/", "acct:2")).await });
        tokio::time::sleep(ttl * 2).await;
        let second = send(
            &slow_router(&unrenewed, Duration::ZERO),
            post_keys("/", "acct:2"),
        )
        .await;
        assert_eq!(
            second.status,
            StatusCode::OK,
            "{name}: the TTL should have run out"
        );
        assert_eq!(first.await.unwrap().status, StatusCode::OK);
    }
    assert!(Observer::of(&server).all_keys().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewal_ends_at_max_hold() {
    let ttl = Duration::from_millis(200);
    let locks = Locks::new(Store::isolated_memory())
        .ttl(ttl)
        .max_hold(Duration::from_millis(300));
    let gate = Gate::new();
    let app = Router::new().route(
        "/",
        post(gated_handler(&gate)).layer(locks.layer(header_keys)),
    );
    let held = tokio::spawn(async move { send(&app, post_keys("/", "k")).await });
    gate.wait_entered().await;
    let lease = gate.lease();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), lease.lost())
        .await
        .expect("a hung handler's lease ends after max_hold and its TTL");
    let lost_after = started.elapsed();
    // Renewed up to max_hold (300 ms), then the last renewal's TTL (200 ms) runs out.
    assert!(lost_after >= Duration::from_millis(300), "{lost_after:?}");
    let free = send(&slow_router(&locks, Duration::ZERO), post_keys("/", "k")).await;
    assert_eq!(free.status, StatusCode::OK, "the keys expired");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------
// 2. Retry-After fits how long holds last, never past the expiry
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_after_follows_observed_holds_not_the_ttl() {
    let server = RedisServer::start();
    for locks in [
        Locks::new(Store::isolated_memory()),
        Locks::new(Redis::pool(server.pool()).build().unwrap()),
    ] {
        let locks = locks.ttl(Duration::from_secs(30));
        // Holds of about 300 ms, one after another.
        for i in 0..3 {
            let key = format!("warm:{i}");
            let reply = send(
                &slow_router(&locks, Duration::from_millis(300)),
                post_keys("/", &key),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK);
        }
        let gate = Gate::new();
        let app = Router::new().route(
            "/",
            post(gated_handler(&gate)).layer(locks.layer(header_keys)),
        );
        let held = tokio::spawn(async move { send(&app, post_keys("/", "busy")).await });
        gate.wait_entered().await;

        let refused = send(&slow_router(&locks, Duration::ZERO), post_keys("/", "busy")).await;
        assert_eq!(refused.status, StatusCode::CONFLICT);
        assert_eq!(
            refused.retry_after(),
            1,
            "holds last 300 ms, not the 30 s TTL"
        );

        let by_expiry = locks.clone().retry_after(RetryAfter::Expiry);
        let refused = send(
            &slow_router(&by_expiry, Duration::ZERO),
            post_keys("/", "busy"),
        )
        .await;
        assert!(
            (29..=30).contains(&refused.retry_after()),
            "{}",
            refused.retry_after()
        );

        // A fixed hint is capped by the expiry.
        let fixed = locks
            .clone()
            .retry_after(RetryAfter::Fixed(Duration::from_secs(600)));
        let refused = send(&slow_router(&fixed, Duration::ZERO), post_keys("/", "busy")).await;
        assert!(refused.retry_after() <= 30, "{}", refused.retry_after());
        gate.open();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
    }
}

// ---------------------------------------------------------------------------------------
// 3. Locks::check: the store can serve, or an error that says why, within the timeout
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_says_whether_the_store_can_serve_within_the_store_timeout() {
    assert!(Locks::new(Store::isolated_memory()).check().await.is_ok());

    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let locks = Locks::new(Redis::url(server.url()).build().unwrap()).store_timeout(timeout);
    locks.check().await.expect("a live Redis 7 serves locks");

    server.pause();
    let started = Instant::now();
    let frozen = locks
        .check()
        .await
        .expect_err("a frozen Redis cannot serve");
    let took = started.elapsed();
    server.resume();
    assert!(took < timeout + Duration::from_millis(200), "{took:?}");
    assert!(frozen.to_string().contains("did not answer"), "{frozen}");

    server.kill();
    let down = Locks::new(Redis::url(server.url()).build().unwrap()).store_timeout(timeout);
    let error = down
        .check()
        .await
        .expect_err("a stopped Redis cannot serve");
    eprintln!("check of a stopped Redis: {error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_needs_a_majority_of_the_redlock_masters() {
    let mut masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let locks = Locks::new(Redlock::new(&urls).build().unwrap());
    locks.check().await.expect("three masters");
    masters[0].kill();
    locks
        .check()
        .await
        .expect("two of three masters are a majority");
    masters[1].kill();
    let error = locks.check().await.expect_err("one of three is not");
    assert!(error.to_string().contains("1 of 3"), "{error}");
}

// ---------------------------------------------------------------------------------------
// 4. A layer overrides the TTL and the contention status of its Locks
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_overrides_ttl_and_contention_status() {
    let server = RedisServer::start();
    let observer = Observer::of(&server);
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap()).renew_lease(false);
    let gate = Gate::new();
    let layer = locks
        .layer(header_keys)
        .ttl(Duration::from_secs(120))
        .contention_status(StatusCode::LOCKED);
    let app = Router::new().route("/", post(gated_handler(&gate)).layer(layer));
    let contender = app.clone();
    let held = tokio::spawn(async move { send(&app, post_keys("/", "doc")).await });
    gate.wait_entered().await;
    assert!(observer.pttl("lock:doc") > 60_000, "the layer's TTL");
    let refused = send(&contender, post_keys("/", "doc")).await;
    assert_eq!(refused.status, StatusCode::LOCKED);
    // The handle itself keeps its own policy.
    let plain = send(&slow_router(&locks, Duration::ZERO), post_keys("/", "doc")).await;
    assert_eq!(plain.status, StatusCode::CONFLICT);
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------
// 5. The application builds the refusal responses, when it wants to
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_refusal_response_hook_builds_every_refusal_of_the_layer() {
    use axum::response::{IntoResponse, Response};
    use tower_batch_lock::Rejection;

    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = {
        let seen = seen.clone();
        move |rejection: Rejection| -> Response {
            seen.lock().unwrap().push(rejection.status());
            let status = rejection.status();
            (status, format!("custom: {}", rejection.detail())).into_response()
        }
    };
    let mut server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .max_keys(2)
        .store_timeout(Duration::from_millis(300))
        .refusal_response(hook);

    let gate = Gate::new();
    let app = Router::new().route(
        "/",
        post(gated_handler(&gate)).layer(locks.layer(header_keys)),
    );
    let held = tokio::spawn(async move { send(&app, post_keys("/", "a")).await });
    gate.wait_entered().await;
    let contended = send(&slow_router(&locks, Duration::ZERO), post_keys("/", "a")).await;
    assert_eq!(contended.status, StatusCode::CONFLICT);
    assert!(
        contended.text().starts_with("custom: "),
        "{}",
        contended.text()
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);

    let too_many = send(
        &slow_router(&locks, Duration::ZERO),
        post_keys("/", "a,b,c"),
    )
    .await;
    assert_eq!(too_many.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        too_many.text().starts_with("custom: "),
        "{}",
        too_many.text()
    );

    server.kill();
    let down = send(&slow_router(&locks, Duration::ZERO), post_keys("/", "a")).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(down.text().starts_with("custom: "), "{}", down.text());
    assert_eq!(
        *seen.lock().unwrap(),
        [
            StatusCode::CONFLICT,
            StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::SERVICE_UNAVAILABLE
        ]
    );
}
