//! Metrics (issue 13): every answer a client saw is counted once, under its outcome; the
//! gauges come back to zero when the layer is idle; waiting and holding are timed. Checked
//! against what the clients were answered, on the memory store and a real Redis.

use std::{
    collections::BTreeMap,
    sync::{Mutex, OnceLock},
    time::Duration,
};
use tower_batch_lock::store::{Redis, Store};

use axum::{routing::post, Router};
use http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower_batch_lock::{Locks, Wait};

use crate::support::{
    handlers::{gated_handler, hold, Gate},
    http::{header_keys, post_keys, send},
    RedisServer,
};

/// A metric, by name and labels.
type Id = (String, Vec<(String, String)>);

/// Everything recorded in this test binary, by every module's tests once the recorder is
/// installed. The debugging recorder's snapshots reset what they read, so they are added up
/// here, and every test reads the sum under its own labels: layer names and routes that no
/// other test uses.
struct Recorded {
    /// Held from a snapshot until what it read is added up: a test that refreshes while
    /// another test's snapshot is on its way to the sums would read them without it.
    snapshotter: Mutex<Snapshotter>,
    counters: Mutex<BTreeMap<Id, u64>>,
    gauges: Mutex<BTreeMap<Id, f64>>,
    histograms: Mutex<BTreeMap<Id, Vec<f64>>>,
}

/// The recorder, installed on the first call (each test calls it before it starts, so
/// that nothing it does goes unrecorded), with everything recorded so far.
fn recorded() -> &'static Recorded {
    static RECORDED: OnceLock<Recorded> = OnceLock::new();
    let recorded = RECORDED.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        Recorded {
            snapshotter: Mutex::new(snapshotter),
            counters: Mutex::default(),
            gauges: Mutex::default(),
            histograms: Mutex::default(),
        }
    });
    recorded.refresh();
    recorded
}

impl Recorded {
    fn refresh(&self) {
        let snapshotter = self.snapshotter.lock().unwrap();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let id = (key.name().to_owned(), labels);
            match value {
                DebugValue::Counter(n) => {
                    *self.counters.lock().unwrap().entry(id).or_default() += n
                }
                // Gauges are changed by increments: what a snapshot reads is the change since
                // the last one.
                DebugValue::Gauge(v) => *self.gauges.lock().unwrap().entry(id).or_default() += v.0,
                DebugValue::Histogram(values) => self
                    .histograms
                    .lock()
                    .unwrap()
                    .entry(id)
                    .or_default()
                    .extend(values.into_iter().map(|v| v.0)),
            }
        }
    }

    fn id(name: &str, labels: &[(&str, &str)]) -> Id {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        labels.sort();
        (name.to_owned(), labels)
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let counters = self.counters.lock().unwrap();
        counters.get(&Self::id(name, labels)).copied().unwrap_or(0)
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let gauges = self.gauges.lock().unwrap();
        gauges.get(&Self::id(name, labels)).copied().unwrap_or(0.0)
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        let histograms = self.histograms.lock().unwrap();
        histograms
            .get(&Self::id(name, labels))
            .cloned()
            .unwrap_or_default()
    }

    /// The acquisitions counted under `layer`, by outcome.
    fn outcomes(&self, layer: &str) -> [u64; 5] {
        [
            "granted",
            "contended",
            "unavailable",
            "rejected",
            "abandoned",
        ]
        .map(|outcome| {
            self.counter(
                "tower_batch_lock_acquisitions_total",
                &[
                    ("layer", layer),
                    ("mode", "exclusive"),
                    ("outcome", outcome),
                ],
            )
        })
    }
}

fn locked(locks: &Locks, route: &str) -> Router {
    Router::new().route(route, post(|| async {}).layer(locks.layer(header_keys)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answer_is_counted_once_under_its_outcome() {
    recorded();
    let server = RedisServer::start();
    let stores = [
        ("counted-memory", Locks::new(Store::isolated_memory())),
        (
            "counted-redis",
            Locks::new(Redis::pool(server.pool()).build().unwrap()),
        ),
    ];
    for (name, locks) in stores {
        let locks = locks.metrics_label(name).max_keys(3);
        let gate = Gate::new();
        let holder = Router::new().route(
            "/",
            post(gated_handler(&gate)).layer(locks.layer(header_keys)),
        );
        let held = tokio::spawn(async move { send(&holder, post_keys("/", "a")).await });
        gate.wait_entered().await;
        assert_eq!(
            recorded().gauge("tower_batch_lock_held_batches", &[("layer", name)]),
            1.0,
            "{name}: one batch held"
        );

        // What the clients see: 5 refusals, 1 bad request, then 1 more grant.
        let app = locked(&locks, "/");
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(send(&app, post_keys("/", "a,b")).await.status);
        }
        statuses.push(send(&app, post_keys("/", "a,b,c,d")).await.status);
        gate.open();
        statuses.push(held.await.unwrap().status);
        statuses.push(send(&app, post_keys("/", "a,b")).await.status);
        let seen = |status| statuses.iter().filter(|&&s| s == status).count() as u64;

        let recorded = recorded();
        let [granted, contended, unavailable, rejected, abandoned] = recorded.outcomes(name);
        assert_eq!(
            contended,
            seen(StatusCode::CONFLICT),
            "{name}: {statuses:?}"
        );
        assert_eq!(granted, seen(StatusCode::OK), "{name}: {statuses:?}");
        assert_eq!(rejected, seen(StatusCode::PAYLOAD_TOO_LARGE), "{name}");
        assert_eq!(
            (granted, contended, unavailable, rejected, abandoned),
            (2, 5, 0, 1, 0),
            "{name}"
        );
        let acquired = recorded.samples(
            "tower_batch_lock_acquire_seconds",
            &[
                ("layer", name),
                ("mode", "exclusive"),
                ("outcome", "contended"),
            ],
        );
        assert_eq!(acquired.len(), 5, "{name}");
        let sizes = recorded.samples("tower_batch_lock_keys", &[("layer", name)]);
        assert_eq!(sizes.len(), 7, "{name}: batches that got to the store");
        assert!(
            sizes.iter().all(|&n| n == 1.0 || n == 2.0),
            "{name}: {sizes:?}"
        );
        let holds = recorded.samples("tower_batch_lock_hold_seconds", &[("layer", name)]);
        assert_eq!(holds.len(), 2, "{name}");
        assert_eq!(
            recorded.gauge("tower_batch_lock_held_batches", &[("layer", name)]),
            0.0,
            "{name}: back to zero when idle"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_requests_are_counted_while_they_wait_and_timed() {
    recorded();
    let locks = Locks::new(Store::isolated_memory())
        .metrics_label("waiting")
        .wait(Wait::up_to(Duration::from_secs(5)));
    let (gate, held) = hold(&locks, "w").await;
    let app = locked(&locks, "/");
    let waiter = tokio::spawn(async move { send(&app, post_keys("/", "w")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let labels = [("layer", "waiting"), ("mode", "exclusive")];
    assert_eq!(
        recorded().gauge("tower_batch_lock_waiting_requests", &labels),
        1.0
    );
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
    let recorded = recorded();
    assert_eq!(
        recorded.gauge("tower_batch_lock_waiting_requests", &labels),
        0.0
    );
    let waited = recorded.samples("tower_batch_lock_wait_seconds", &labels);
    assert_eq!(waited.len(), 1);
    assert!(waited[0] >= 0.09, "{waited:?}");
}

/// A handler that outlives its layer's `max_hold` loses its lease when the keys expire,
/// counted as every lost lease is; one that ends first loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_past_its_max_hold_is_counted_lost_when_its_keys_expire() {
    recorded();
    let locks = Locks::new(Store::isolated_memory())
        .metrics_label("holding-long")
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_millis(150));
    let app = Router::new().route(
        "/",
        post(|lease: tower_batch_lock::Lease| async move {
            lease.lost().await;
            "lost"
        })
        .layer(locks.layer(header_keys)),
    );
    let reply = send(&app, post_keys("/", "long")).await;
    assert_eq!(reply.status, StatusCode::OK);
    let lost = || {
        recorded().counter(
            "tower_batch_lock_lost_leases_total",
            &[("layer", "holding-long")],
        )
    };
    // Counted by the renewal's task, which the release stops at that moment.
    let counted =
        crate::support::http::poll_every(Duration::from_millis(10), Duration::from_secs(1), || {
            lost() == 1
        });
    assert!(counted.await.is_some(), "the lost lease was not counted");
    // Released within its max_hold: nothing lost.
    let quick = locked(&locks, "/quick");
    assert_eq!(
        send(&quick, post_keys("/quick", "long")).await.status,
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(lost(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_whose_client_goes_away_is_counted_abandoned() {
    recorded();
    let locks = Locks::new(Store::isolated_memory())
        .metrics_label("abandoning")
        .wait(Wait::up_to(Duration::from_secs(5)));
    let (gate, held) = hold(&locks, "gone").await;
    // The client hangs up while its request waits: hyper drops the request's future.
    let app = locked(&locks, "/");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(150),
        tower::ServiceExt::oneshot(app, post_keys("/", "gone")),
    )
    .await;
    assert!(gave_up.is_err(), "the waiter waits for the holder");
    gate.open();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);

    let recorded = recorded();
    assert_eq!(recorded.outcomes("abandoning"), [1, 0, 0, 0, 1]);
    let took = recorded.samples(
        "tower_batch_lock_acquire_seconds",
        &[
            ("layer", "abandoning"),
            ("mode", "exclusive"),
            ("outcome", "abandoned"),
        ],
    );
    assert!(took.len() == 1 && took[0] >= 0.14, "{took:?}");
    let waiting = [("layer", "abandoning"), ("mode", "exclusive")];
    assert_eq!(
        recorded.gauge("tower_batch_lock_waiting_requests", &waiting),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_without_a_name_is_labelled_with_its_route_and_an_outage_is_unavailable() {
    recorded();
    let mut server = RedisServer::start();
    let locks = Locks::new(Redis::pool(server.pool()).build().unwrap())
        .store_timeout(Duration::from_millis(300));
    let app = Router::new().route(
        "/shipments/{id}",
        post(|| async {}).layer(locks.layer(tower_batch_lock::keys::path("shipment"))),
    );
    let ok = send(
        &app,
        http::Request::post("/shipments/7")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK);
    server.kill();
    let down = send(
        &app,
        http::Request::post("/shipments/7")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    let [granted, _, unavailable, ..] = recorded().outcomes("/shipments/{id}");
    assert_eq!((granted, unavailable), (1, 1));
}
