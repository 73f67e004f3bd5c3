//! The span the layer opens for each locked request.
//!
//! Read from the test binary's global subscriber (`support::logs`): a thread-local one
//! (`tracing::subscriber::set_default`) races the other tests' threads over tracing's
//! global cache of which spans are enabled, and sometimes missed spans. The requests run in
//! a `traced` span, so that the log holds this test's spans and none of the other tests'.

use std::{sync::Arc, time::Duration};
use tower_batch_lock::store::Store;

use axum::{routing::post, Router};
use http::StatusCode;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_batch_lock::Locks;
use tracing::Instrument;

use crate::support::{
    http::{header_keys, post_keys},
    logs::{traced, traced_logged},
};

#[tokio::test]
async fn each_locked_request_has_a_span_with_its_key_count_outcome_and_acquire_time() {
    let span = traced();
    let locks = Locks::new(Store::isolated_memory());
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let holding = {
        let (entered, release) = (entered.clone(), release.clone());
        post(move || async move {
            entered.notify_one();
            release.notified().await;
        })
    };
    let holder = Router::new().route("/", holding.layer(locks.layer(header_keys)));
    let holder = tokio::spawn(
        holder
            .oneshot(post_keys("/", "a,b"))
            .instrument(span.clone()),
    );
    entered.notified().await;

    let quick = Router::new().route("/", post(|| async {}).layer(locks.layer(header_keys)));
    let refused = quick
        .oneshot(post_keys("/", "b,c,d"))
        .instrument(span)
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    release.notify_one();
    let granted = tokio::time::timeout(Duration::from_secs(10), holder).await;
    assert_eq!(granted.unwrap().unwrap().unwrap().status(), StatusCode::OK);

    let output = traced_logged();
    let closed: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("lock{") && l.contains("close"))
        .collect();
    assert_eq!(closed.len(), 2, "{output}");
    let granted = |l: &&str| l.contains("keys=2") && l.contains("outcome=\"granted\"");
    let contended = |l: &&str| l.contains("keys=3") && l.contains("outcome=\"contended\"");
    assert!(closed.iter().any(granted), "{output}");
    assert!(closed.iter().any(contended), "{output}");
    assert!(closed.iter().all(|l| l.contains("acquire_ms=")), "{output}");
}
