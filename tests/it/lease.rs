//! The lease as a handler sees it: taken as an extractor (`Lease`, `Option<Lease>`,
//! `Extension<Lease>`), refused in problem+json where it is missing, and shown by `Debug`.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tower_batch_lock::store::Store;

use axum::{routing::post, Extension, Router};
use http::{Request, StatusCode};
use tower_batch_lock::{Lease, Locks};

use crate::support::{
    handlers::{gated_handler, Gate},
    http::{header_keys, post_keys, send, send_text},
    logs::errors_logged,
};

/// A route `POST /` that locks the keys of the `x-keys` header and runs `handler`.
fn locked<H, T>(locks: &Locks, handler: H) -> Router
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    Router::new().route("/", post(handler).layer(locks.layer(header_keys)))
}

#[tokio::test]
async fn a_handler_takes_its_lease_as_an_extractor() {
    let locks = Locks::new(Store::isolated_memory()).prefix("app:");
    let app = locked(
        &locks,
        |lease: Lease, Extension(same): Extension<Lease>| async move {
            // `Extension<Lease>` keeps working, and sees the same grant.
            assert_eq!(lease.fencing_token(), same.fencing_token());
            lease.keys().collect::<Vec<_>>().join(",")
        },
    );
    let reply = send_text(&app, post_keys("/", "b,a")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "a,b");
}

#[tokio::test]
async fn an_optional_lease_is_none_when_the_request_names_no_keys() {
    let locks = Locks::new(Store::isolated_memory()).require_keys(false);
    let app = locked(&locks, |lease: Option<Lease>| async move {
        match lease {
            Some(lease) => lease.keys().collect::<Vec<_>>().join(","),
            None => "unlocked".to_owned(),
        }
    });
    let unnamed = Request::post("/").body(Default::default()).unwrap();
    assert_eq!(send_text(&app, unnamed).await.body, "unlocked");
    assert_eq!(send_text(&app, post_keys("/", "a")).await.body, "a");
}

#[tokio::test]
async fn a_route_without_the_layer_answers_500_in_problem_json_and_logs_why_once() {
    errors_logged();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new().route(
        "/unlocked",
        post(move |_: Lease| async move {
            counted.fetch_add(1, Ordering::SeqCst);
        }),
    );
    for _ in 0..3 {
        let reply = send_text(&app, post_keys("/unlocked", "a")).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            reply.detail(),
            "the handler needs locks on this request's resources, but the request holds none"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler never runs");

    // One error line for the route, not one a request.
    let logged = errors_logged();
    let lines: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("path=/unlocked"))
        .collect();
    let [line] = lines[..] else {
        panic!("not one error logged for /unlocked: {logged}");
    };
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains("the route has no LockLayer, or the request named no keys"),
        "{line}"
    );
}

#[tokio::test]
async fn a_required_lease_answers_500_when_the_request_names_no_keys() {
    errors_logged();
    // A route that lets requests without keys pass unlocked, and a handler that needs a
    // lease all the same: the server's mistake.
    let locks = Locks::new(Store::isolated_memory()).require_keys(false);
    let app = Router::new().route(
        "/no-keys",
        post(|_: Lease| async {}).layer(locks.layer(header_keys)),
    );
    let reply = send_text(
        &app,
        Request::post("/no-keys").body(Default::default()).unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem()["title"], "Internal Server Error");
    assert!(
        errors_logged().contains("path=/no-keys"),
        "{}",
        errors_logged()
    );
}

#[tokio::test]
async fn debug_shows_the_keys_the_fence_the_time_left_and_whether_it_is_lost() {
    let locks = Locks::new(Store::isolated_memory())
        .prefix("app:")
        .ttl(Duration::from_secs(30));
    let gate = Gate::new();
    let app = locked(&locks, gated_handler(&gate));
    let holder = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_keys("/", "b,a")).await }
    });
    gate.wait_entered().await;
    let lease = gate.lease();

    let shown = format!("{lease:?}");
    let fence = lease.fencing_token();
    let expected_start =
        format!(r#"Lease {{ keys: ["a", "b"], fencing_token: {fence}, expires_in: "#);
    assert!(shown.starts_with(&expected_start), "{shown}");
    assert!(shown.ends_with("s, lost: false }"), "{shown}");
    let expires_in = &shown[expected_start.len()..shown.len() - ", lost: false }".len()];
    let seconds: f64 = expires_in.trim_end_matches('s').parse().unwrap();
    assert!(seconds > 25.0 && seconds <= 30.0, "{shown}");

    gate.open();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    // Released with the response: the copy the test kept says so.
    assert!(format!("{lease:?}").ends_with("lost: true }"), "{lease:?}");
}

#[tokio::test]
async fn debug_shows_the_first_twenty_keys_of_a_large_batch_and_counts_the_rest() {
    let keys: Vec<String> = (0..25).map(|i| format!("k{i:02}")).collect();
    let app = locked(
        &Locks::new(Store::isolated_memory()),
        |lease: Lease| async move { format!("{lease:?}") },
    );
    let shown = send_text(&app, post_keys("/", &keys.join(","))).await.body;
    let listed: Vec<String> = keys[..20].iter().map(|k| format!("{k:?}")).collect();
    let expected = format!("keys: [{}, ... and 5 more]", listed.join(", "));
    assert!(shown.contains(&expected), "{shown}");
}

#[tokio::test]
async fn contention_detail_agrees_in_number_with_the_held_count() {
    let locks = Locks::new(Store::isolated_memory());
    let gate = Gate::new();
    let holder = tokio::spawn({
        let app = locked(&locks, gated_handler(&gate));
        async move { send(&app, post_keys("/", "a")).await }
    });
    gate.wait_entered().await;

    let quick = locked(&locks, || async {});
    let one_of_two = send_text(&quick, post_keys("/", "a,b")).await;
    assert_eq!(one_of_two.status, StatusCode::CONFLICT);
    assert_eq!(
        one_of_two.detail(),
        "1 of the 2 resources this request locks is held by another request"
    );

    gate.open();
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
}

#[tokio::test]
async fn a_lease_kept_past_its_request_is_lost_once_the_layer_releases_it() {
    // A long TTL: only the release can end the lease within the test.
    let locks = Locks::new(Store::isolated_memory()).ttl(Duration::from_secs(60));
    let (kept, mut taken) = tokio::sync::mpsc::unbounded_channel();
    let app = locked(&locks, move |lease: Lease| {
        let kept = kept.clone();
        async move {
            assert!(!lease.is_lost(), "a lease is lost while its handler runs");
            // Waiting for the loss starts before the release, and must be woken by it.
            let waiter = lease.clone();
            let lost = tokio::spawn(async move { waiter.lost().await });
            kept.send((lease, lost)).unwrap();
            "ok"
        }
    });
    assert_eq!(send(&app, post_keys("/", "a")).await.status, StatusCode::OK);
    let (lease, lost) = taken.recv().await.unwrap();
    assert!(lease.is_lost(), "a released lease is not lost");
    tokio::time::timeout(Duration::from_secs(2), lost)
        .await
        .expect("lost() did not resolve when the layer released the keys")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), lease.lost())
        .await
        .expect("lost() of a released lease did not resolve at once");
}

/// How long the handler's `lease.lost()` took to fire (at most 2 s), with its keys.
async fn lost_after(lease: Lease) -> String {
    let started = std::time::Instant::now();
    let keys = lease.keys().collect::<Vec<_>>().join(",");
    let lost = tokio::time::timeout(Duration::from_secs(2), lease.lost()).await;
    match lost {
        Ok(()) => format!("{keys} lost after {} ms", started.elapsed().as_millis()),
        Err(_) => format!("{keys} never lost"),
    }
}

/// The milliseconds in a [`lost_after`] answer, or `None` for "never lost".
fn lost_ms(answer: &str) -> Option<u128> {
    answer
        .rsplit_once("lost after ")?
        .1
        .strip_suffix(" ms")?
        .parse()
        .ok()
}

/// Two lock layers on one route, outer first: the handler's lease is the inner one's, and
/// speaks for both: all their keys, the earlier expiry, lost when the outer hold is.
#[tokio::test]
async fn the_lease_under_two_layers_is_lost_when_the_outer_hold_is() {
    // The outer layer's hold is not renewed: it runs out after 300 ms.
    let outer = Locks::new(Store::isolated_memory())
        .ttl(Duration::from_millis(300))
        .renew_lease(false);
    let inner = Locks::new(Store::isolated_memory());
    let app = Router::new().route(
        "/",
        post(|lease: Lease| async move {
            let expires_in = lease.expires_at() - std::time::Instant::now();
            assert!(expires_in <= Duration::from_millis(300), "{expires_in:?}");
            lost_after(lease).await
        })
        .layer(
            tower::ServiceBuilder::new()
                .layer(outer.layer(|_: &http::request::Parts| Ok::<_, StatusCode>(["order:1"])))
                .layer(inner.layer(header_keys)),
        ),
    );
    let answer = send_text(&app, post_keys("/", "sku:a,sku:b")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.body.starts_with("order:1,sku:a,sku:b lost after"),
        "{}",
        answer.body
    );
    let ms = lost_ms(&answer.body).unwrap();
    assert!((250..1000).contains(&ms), "{}", answer.body);
}

/// The loss of the idempotency layer's in-flight hold never cancels the request, even
/// where a lock layer inside cancels on a lost lease: its handler sees the loss and
/// answers. Cancelled half-way, it would have stored nothing, and its retry would run it
/// again.
#[cfg(feature = "idempotency")]
#[tokio::test]
async fn the_loss_of_the_in_flight_hold_never_cancels_a_lock_layer_inside() {
    let in_flight = Locks::new(Store::isolated_memory()).ttl(Duration::from_millis(300));
    let operator = in_flight.clone().prefix("idempotency:lock:");
    let inner =
        Locks::new(Store::isolated_memory()).on_lost_lease(tower_batch_lock::OnLostLease::Cancel);
    let app = Router::new().route(
        "/",
        post(|lease: Lease| lost_after(lease))
            .layer(inner.layer(header_keys))
            .layer(in_flight.idempotency()),
    );
    let request = Request::post("/")
        .header("x-keys", "sku:a")
        .header("idempotency-key", "\"k-3\"")
        .body(axum::body::Body::empty())
        .unwrap();
    let answer = tokio::spawn(async move { send_text(&app, request).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let ended = operator
        .force_release(["run:0::k-3"], "test")
        .await
        .unwrap();
    assert_eq!(ended, 1, "the in-flight hold was still there");
    let answer = answer.await.unwrap();
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert!(answer.body.contains("lost after"), "{}", answer.body);
}

/// The idempotency layer's in-flight hold counts in the lease of a lock layer inside it.
#[cfg(feature = "idempotency")]
#[tokio::test]
async fn the_lease_inside_the_idempotency_layer_is_lost_with_its_in_flight_hold() {
    // The in-flight hold is renewed whatever `max_hold` says (a retry must not run beside
    // its first request), so it is lost only when the store loses it: here, an operator
    // ends it 700 ms in.
    let in_flight = Locks::new(Store::isolated_memory())
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_millis(300));
    let operator = in_flight.clone().prefix("idempotency:lock:");
    let inner = Locks::new(Store::isolated_memory());
    for outer in [None, Some(Locks::new(Store::isolated_memory()))] {
        let route = post(|lease: Lease| lost_after(lease))
            .layer(inner.layer(header_keys))
            .layer(in_flight.idempotency());
        let app = match &outer {
            Some(outer) => Router::new().route(
                "/",
                route.layer(
                    outer.layer(|_: &http::request::Parts| Ok::<_, StatusCode>(["order:1"])),
                ),
            ),
            None => Router::new().route("/", route),
        };
        let key = if outer.is_some() { "k-2" } else { "k-1" };
        let request = Request::post("/")
            .header("x-keys", "sku:a")
            .header("idempotency-key", format!("\"{key}\""))
            .body(axum::body::Body::empty())
            .unwrap();
        let answer = tokio::spawn(async move { send_text(&app, request).await });
        tokio::time::sleep(Duration::from_millis(700)).await;
        let ended = operator
            .force_release([format!("run:0::{key}")], "test")
            .await
            .unwrap();
        assert_eq!(ended, 1, "the in-flight hold was still there");
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
        let ms = lost_ms(&answer.body);
        assert!(
            ms.is_some_and(|ms| (650..1300).contains(&ms)),
            "{}",
            answer.body
        );
        assert!(answer.body.contains("sku:a"), "{}", answer.body);
    }
}
