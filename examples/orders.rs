//! An order service that takes stock from thousands of SKUs at once and never oversells.
//!
//! `POST /orders` locks the order and every SKU it lists as one batch, all or nothing,
//! before its handler runs. The handler then reads the stock levels, does some slow work,
//! and writes the new levels: a read-modify-write that is *not* atomic in the store, so
//! only the locks keep two orders for the same SKU from both selling the last unit. An
//! order that finds one of its SKUs locked gets `409 Conflict` and may retry.
//!
//! - `PUT /stock/{sku}` with `{"qty": 10}` sets a stock level, under the lock `sku:{sku}`.
//! - `GET /stock/{sku}` reads a stock level (unlocked), or 404.
//! - `POST /orders` with `{"order_id": "o-1", "items": [{"sku": "apple", "qty": 3}]}`
//!   places an order: 201 with the order and the `fence` (fencing token) of its locks; 200
//!   with the stored order if it was placed
//!   before (nothing is taken twice); 422 if a SKU lacks stock (nothing is taken); 409
//!   with `Retry-After` while another request holds one of its locks.
//! - `GET /orders/{order_id}` reads an order, or 404.
//! - `POST /quotes` with the body of an order (`order_id` optional) quotes it without
//!   placing it: 200 with `{"available": true, "levels": {"apple": 7}}`, whether every item
//!   is in stock and the level of each SKU (0 for one without a level). It holds the
//!   locks `sku:{sku}` of its items *shared*: quotes run together, and never while an order
//!   or a stock update holds one of their SKUs (409 with `Retry-After`, as for orders). It
//!   writes nothing, and the idempotency layer leaves it alone.
//!
//! A process that pauses past its lease (a stall, `SIGSTOP`) cannot overwrite the sale of
//! the instance that was granted the SKUs after it: in Redis (`REDIS_URL`, `REDIS_URLS`),
//! stock and orders are written with the request's fencing token
//! ([`tower_batch_lock::fenced::set`]; on a cluster, whose keys span slots,
//! [`tower_batch_lock::fenced::set_across_slots`]), and a write older than the last one is
//! refused; in PostgreSQL (`DATABASE_URL`), the transaction that writes them first checks,
//! with the store's guard, that the request still holds its locks, and fails if not.
//! Either way that order gets 409 and takes nothing. (In memory, the process that holds
//! the locks holds the data: the writes are plain.)
//!
//! `POST /orders` also takes an optional `Idempotency-Key` header: a retry with the same
//! key and body gets the first answer again, marked `Idempotent-Replayed: true`; the same
//! key with another body is 422, and a retry while the first still runs is 409.
//!
//! Every refusal is an `application/problem+json` document.
//!
//! Environment:
//!
//! - `ORDERS_ADDR`: where to listen, default `127.0.0.1:3000`.
//! - `REDIS_URL`: keep the locks and the data in this Redis, shared by every instance that
//!   uses it (`redis://127.0.0.1/`). Without it, both live in this process's memory.
//! - `REDIS_URLS`: instead, lock with Redlock over these independent Redis masters,
//!   comma-separated (`redis://10.0.0.1/,redis://10.0.0.2/,redis://10.0.0.3/`), and keep
//!   the data in the first of them.
//! - `REDIS_CLUSTER_URLS`: instead, keep the locks and the data on a Redis Cluster, given
//!   by any of its nodes, comma-separated (`redis://10.0.0.1:7000/,redis://10.0.0.2:7000/`);
//!   needs the `cluster` feature.
//! - `DATABASE_URL`: instead, keep the locks, the data (tables `orders.stock` and
//!   `orders.orders`, made at start) and the idempotency answers in this PostgreSQL
//!   database (`postgres://user@127.0.0.1/shop`); needs the `postgres` feature. Set one of
//!   `REDIS_URL`, `REDIS_URLS`, `REDIS_CLUSTER_URLS` and `DATABASE_URL`.
//! - `WORK_DELAY_MS`: how long the slow work of an order or a quote takes inside its
//!   locks, default 0.
//! - `LOCK_TTL_MS`: the lease on the locks, default 30000; renewed every third of it while
//!   an order works, so slow work never outlives its locks.
//! - `LOCK_WAIT_MS`: how long a request waits for busy locks before it gets 409, default 0
//!   (fail fast). A waiter wakes when the locks are released, in any instance.
//! - `LOCK_FAIR`: `0` lets waiters race for the locks instead of being served in order of
//!   arrival (default `1`: a purchase order of thousands of SKUs is not starved by retail
//!   orders of a few).
//! - `ADMIN_ADDR`: the admin port, default `127.0.0.1:3001`: `GET /metrics` (Prometheus
//!   text) and, built with the `admin` feature, the operator's view of the locks under
//!   `/admin` (`GET /admin/locks?key=sku:apple`, `GET /admin/locks/held`,
//!   `POST /admin/locks/force-release`). Never expose it where clients can reach it.
//! - `RUST_LOG`: the log filter, default `info`.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1/ WORK_DELAY_MS=50 cargo run --example orders
//! REDIS_URLS=redis://127.0.0.1:7001/,redis://127.0.0.1:7002/,redis://127.0.0.1:7003/ \
//!     cargo run --example orders
//! REDIS_CLUSTER_URLS=redis://127.0.0.1:7000/,redis://127.0.0.1:7001/ \
//!     cargo run --example orders --features cluster
//! DATABASE_URL=postgres://postgres@127.0.0.1/shop cargo run --example orders --features postgres
//! curl -X PUT localhost:3000/stock/apple -H 'content-type: application/json' -d '{"qty": 10}'
//! curl -X POST localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"order_id": "o-1", "items": [{"sku": "apple", "qty": 3}]}'
//! curl -X POST localhost:3000/quotes -H 'content-type: application/json' \
//!      -d '{"items": [{"sku": "apple", "qty": 3}]}'
//! ```

use std::{
    collections::{BTreeMap, HashMap},
    env,
    error::Error,
    io::IsTerminal,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    extract::{FromRequest, Path, Request, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post, put, MethodRouter},
    Json, Router,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
#[cfg(feature = "postgres")]
use tower_batch_lock::tokio_postgres;
#[cfg(feature = "redis")]
use tower_batch_lock::FencingToken;
use tower_batch_lock::{keys, Lease, Locks, Rejection, Wait};

/// The body of `POST /orders` (`Id` a `String`) and of `POST /quotes`, where `order_id`
/// may be left out (`Id` an `Option<String>`): one type, so that both routes read and
/// refuse the same documents alike.
#[derive(Debug, Deserialize)]
struct OrderBody<Id> {
    order_id: Id,
    items: Vec<Item>,
}

/// The body of `POST /orders`.
type NewOrder = OrderBody<String>;

/// The body of `POST /quotes`.
type QuoteRequest = OrderBody<Option<String>>;

/// One line of an order: so many units of one SKU.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Item {
    sku: String,
    qty: u64,
}

/// A placed order, as stored and answered: one item per SKU, sorted by SKU.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    order_id: String,
    items: Vec<Item>,
    /// The fencing token of the locks it was placed under: larger than that of every
    /// earlier grant of any of its SKUs. (Absent only in the tests' unlocked control run.)
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<u64>,
}

/// The answer to `POST /quotes`.
#[derive(Debug, Serialize)]
struct Quote {
    /// Whether every item's quantity is in stock.
    available: bool,
    /// The stock level of each SKU quoted.
    levels: BTreeMap<String, u64>,
}

/// The body of `PUT /stock/{sku}`.
#[derive(Debug, Deserialize)]
struct StockLevel {
    qty: u64,
}

/// What an order locks: the order itself (so that a retry of it waits for the first
/// attempt) and every SKU it takes stock from. The layer adds the `lock:` prefix, drops
/// duplicates and locks them all in one step.
fn order_keys(order: NewOrder) -> impl Iterator<Item = String> {
    std::iter::once(format!("order:{}", order.order_id)).chain(sku_keys(order.items))
}

/// What a quote locks: the SKUs it reads, and not the order, which it never writes (the
/// layer holds them shared).
fn quote_keys(quote: QuoteRequest) -> impl Iterator<Item = String> {
    sku_keys(quote.items)
}

fn sku_keys(items: Vec<Item>) -> impl Iterator<Item = String> {
    // The very key `keys::path("sku")` makes for `PUT /stock/{sku}`: an order, a quote and
    // a stock update of the same SKU must lock the same key, or they would not exclude
    // each other.
    items.into_iter().map(|item| format!("sku:{}", item.sku))
}

/// The service's routes, on `store`, with orders and quotes that work for `work_delay`
/// inside their locks.
///
/// `locks: None` leaves the lock layer out. Never do that in a service: it exists for the
/// tests' control run, which shows the lost updates and overselling that the locks prevent.
pub fn app(store: Store, locks: Option<Locks>, work_delay: Duration) -> Router {
    let mut set_stock = put(set_stock);
    let mut place_order = post(place_order);
    let mut quote = post(quote);
    if let Some(locks) = locks {
        // `PUT /stock/apple` locks `sku:apple`.
        set_stock = set_stock.layer(locks.layer(keys::path("sku")));
        // `POST /orders` locks `order:{order_id}` and `sku:{sku}` of each item, as one batch.
        place_order = idempotent(
            place_order.layer(locks.layer(keys::json(order_keys))),
            &locks,
        );
        // `POST /quotes` holds `sku:{sku}` of each item shared, as one batch. Only a quote
        // without items names no key: it passes unlocked, and the handler refuses it as it
        // refuses such an order (422), not the layer (400). No idempotency layer: a quote
        // changes nothing, so a retry simply runs again.
        let quote_locks = locks.require_keys(false);
        quote = quote.layer(quote_locks.layer(keys::json(quote_keys)).shared());
    }
    Router::new()
        .route("/stock/{sku}", set_stock)
        .route("/stock/{sku}", get(get_stock))
        .route("/orders", place_order)
        .route("/orders/{order_id}", get(get_order))
        .route("/quotes", quote)
        .with_state(AppState { store, work_delay })
}

/// `route` behind the idempotency layer, outside its locks: a request with an
/// `Idempotency-Key` runs once, and a retry gets the first answer again, 201 and all,
/// without taking any lock. (Only a build without the crate's default features lacks it.)
#[cfg(feature = "idempotency")]
fn idempotent(route: MethodRouter<AppState>, locks: &Locks) -> MethodRouter<AppState> {
    route.layer(locks.idempotency())
}

#[cfg(not(feature = "idempotency"))]
fn idempotent(route: MethodRouter<AppState>, _: &Locks) -> MethodRouter<AppState> {
    route
}

#[derive(Debug, Clone)]
struct AppState {
    store: Store,
    work_delay: Duration,
}

async fn set_stock(
    State(app): State<AppState>,
    Path(sku): Path<String>,
    lease: Option<Lease>,
    JsonBody(level): JsonBody<StockLevel>,
) -> Result<Json<Item>, Rejection> {
    let written = app
        .store
        .set_stock(&sku, level.qty, lease.as_ref())
        .await
        .map_err(store_failed)?;
    if !written {
        return Err(lost_lease());
    }
    Ok(Json(Item {
        sku,
        qty: level.qty,
    }))
}

async fn get_stock(
    State(app): State<AppState>,
    Path(sku): Path<String>,
) -> Result<Json<Item>, Rejection> {
    let levels = app.store.stock(&[&sku]).await.map_err(store_failed)?;
    match levels[0] {
        Some(qty) => Ok(Json(Item { sku, qty })),
        None => Err(not_found(format!("no stock level for SKU `{sku}`"))),
    }
}

async fn get_order(
    State(app): State<AppState>,
    Path(order_id): Path<String>,
) -> Result<Json<Order>, Rejection> {
    match app.store.order(&order_id).await.map_err(store_failed)? {
        Some(order) => Ok(Json(order)),
        None => Err(not_found(format!("no order `{order_id}`"))),
    }
}

/// Runs with the order and all its SKUs locked, so nothing else changes them between the
/// read and the write below.
async fn place_order(
    State(app): State<AppState>,
    lease: Option<Lease>,
    JsonBody(order): JsonBody<NewOrder>,
) -> Result<Response, Rejection> {
    check_order_id(&order.order_id)?;
    let wanted = quantities(&order.items)?;

    // Placed before (a retry after a lost response, say): answer it again, take nothing.
    if let Some(placed) = app
        .store
        .order(&order.order_id)
        .await
        .map_err(store_failed)?
    {
        return Ok((StatusCode::OK, Json(placed)).into_response());
    }

    let skus: Vec<&str> = wanted.keys().map(String::as_str).collect();
    let levels = app.store.stock(&skus).await.map_err(store_failed)?;
    let mut remaining = Vec::with_capacity(wanted.len());
    let mut short = Vec::new();
    for ((sku, &qty), level) in wanted.iter().zip(levels) {
        // No stock level is no stock.
        let have = level.unwrap_or(0);
        match have.checked_sub(qty) {
            Some(left) => remaining.push((sku.as_str(), left)),
            None => short.push(format!("`{sku}` (have {have}, want {qty})")),
        }
    }
    if !short.is_empty() {
        let count = short.len();
        short.truncate(10);
        return Err(Rejection::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "not enough stock for {count} SKU(s): {}; nothing was taken",
                short.join(", ")
            ),
        ));
    }

    // Pricing, payment, whatever takes time: the locks keep the levels read above current.
    tokio::time::sleep(app.work_delay).await;

    let placed = Order {
        order_id: order.order_id,
        items: wanted
            .iter()
            .map(|(sku, &qty)| Item {
                sku: sku.clone(),
                qty,
            })
            .collect(),
        fence: lease.as_ref().map(|lease| lease.fencing_token().get()),
    };
    let written = app
        .store
        .commit(&remaining, &placed, lease.as_ref())
        .await
        .map_err(store_failed)?;
    if !written {
        return Err(lost_lease());
    }
    Ok((StatusCode::CREATED, Json(placed)).into_response())
}

/// The answer to a request whose write was refused: it paused past its lease (a stall,
/// a stopped process), and a later holder of one of its keys wrote first. Its write would
/// have lost that one's update; nothing was written.
fn lost_lease() -> Rejection {
    Rejection::new(
        StatusCode::CONFLICT,
        "the locks of this request ran out before it wrote, and another request wrote \
         first; nothing was written: try again",
    )
}

/// Runs with every SKU of the quote held shared, beside other quotes: no order or stock
/// update changes a level between the read and the answer.
async fn quote(
    State(app): State<AppState>,
    JsonBody(quote): JsonBody<QuoteRequest>,
) -> Result<Json<Quote>, Rejection> {
    // A quote is asked with the order it prices, so it refuses what the order would.
    if let Some(order_id) = &quote.order_id {
        check_order_id(order_id)?;
    }
    let wanted = quantities(&quote.items)?;
    let skus: Vec<&str> = wanted.keys().map(String::as_str).collect();
    let levels = app.store.stock(&skus).await.map_err(store_failed)?;

    // Pricing, whatever takes time: the shared locks keep the levels read above current.
    tokio::time::sleep(app.work_delay).await;

    // No stock level is no stock.
    let levels: BTreeMap<String, u64> = wanted
        .keys()
        .cloned()
        .zip(levels.into_iter().map(|level| level.unwrap_or(0)))
        .collect();
    let available = wanted
        .values()
        .zip(levels.values())
        .all(|(want, have)| want <= have);
    Ok(Json(Quote { available, levels }))
}

/// 422 for an empty `order_id`.
fn check_order_id(order_id: &str) -> Result<(), Rejection> {
    if order_id.is_empty() {
        return Err(Rejection::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`order_id` must not be empty",
        ));
    }
    Ok(())
}

/// The quantity of each SKU in `items`, duplicates summed; 422 for items that make no
/// sense. (Malformed JSON never gets here: the lock layer refuses it while reading keys.)
fn quantities(items: &[Item]) -> Result<BTreeMap<String, u64>, Rejection> {
    let invalid = |detail: String| Rejection::new(StatusCode::UNPROCESSABLE_ENTITY, detail);
    if items.is_empty() {
        return Err(invalid("an order needs at least one item".to_owned()));
    }
    let mut wanted = BTreeMap::new();
    for Item { sku, qty } in items {
        if sku.is_empty() {
            return Err(invalid("every item needs a non-empty `sku`".to_owned()));
        }
        if *qty == 0 {
            return Err(invalid(format!(
                "item `{sku}` has `qty` 0; order at least 1"
            )));
        }
        let total: &mut u64 = wanted.entry(sku.clone()).or_default();
        *total = total
            .checked_add(*qty)
            .ok_or_else(|| invalid(format!("the total quantity of `{sku}` is too large")))?;
    }
    Ok(wanted)
}

/// `axum::Json`, refusing a bad body with problem+json like the lock layer does, so that
/// clients get one kind of error document.
struct JsonBody<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = Rejection;

    async fn from_request(request: Request, state: &S) -> Result<Self, Rejection> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(refused) => Err(Rejection::new(refused.status(), refused.body_text())),
        }
    }
}

fn not_found(detail: String) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, detail)
}

/// The store's trouble is the server's, not the client's: 503, the details only in the log.
fn store_failed(error: StoreError) -> Rejection {
    tracing::error!(%error, "the order store failed");
    Rejection::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the order store is unavailable; try again later",
    )
}

type StoreError = Box<dyn Error + Send + Sync>;

/// Where stock levels and orders live. Its reads and writes are plain `MGET`s and `MSET`s:
/// nothing in the store keeps a read and a later write together, the locks do.
#[derive(Debug, Clone)]
pub enum Store {
    /// In this process's memory.
    Memory(Arc<Mutex<Tables>>),
    /// In Redis or a Redis Cluster, under `orders:stock:{sku}` and
    /// `orders:order:{order_id}`: never under the locks' `lock:` prefix.
    #[cfg(feature = "redis")]
    Redis(Remote),
    /// In PostgreSQL, in the tables `orders.stock` and `orders.orders`, written in
    /// transactions that the locks' guard checks.
    #[cfg(feature = "postgres")]
    Postgres {
        /// The data's connections.
        pool: tower_batch_lock::deadpool_postgres::Pool,
        /// The guard's call.
        guard: String,
    },
}

/// Where a Redis store sends its commands.
#[cfg(feature = "redis")]
#[derive(Clone)]
pub enum Remote {
    /// One Redis.
    Pool(deadpool_redis::Pool),
    /// A Redis Cluster: redis-rs splits an `MGET` or `MSET` by slot, and sends each part
    /// to its master.
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

#[cfg(feature = "redis")]
impl Remote {
    /// Writes every `(key, value)`: with the request's fencing token, refused (`false`,
    /// nothing written) where a later token wrote one of the keys; without a lock, as they
    /// are. On a cluster, a write that lost its lease between its slots' calls is an error:
    /// some of it was written.
    async fn write(
        &self,
        writes: &[(String, String)],
        fence: Option<FencingToken>,
    ) -> Result<bool, StoreError> {
        if let Some(token) = fence {
            let writes: Vec<(&str, &str)> = writes
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            return match self {
                Self::Pool(pool) => {
                    let mut redis = pool.get().await?;
                    Ok(tower_batch_lock::fenced::set(&mut *redis, token, &writes).await?)
                }
                #[cfg(feature = "cluster")]
                Self::Cluster(cluster) => {
                    use tower_batch_lock::fenced::{set_across_slots, Written};
                    match set_across_slots(&mut cluster.clone(), token, &writes).await? {
                        Written::All => Ok(true),
                        Written::Nothing => Ok(false),
                        Written::Partly => Err("the lease ran out during a write: \
                                                some slots were written"
                            .into()),
                    }
                }
            };
        }
        let mut mset = redis::cmd("MSET");
        for (key, value) in writes {
            mset.arg(key).arg(value);
        }
        self.query::<()>(&mset).await?;
        Ok(true)
    }

    async fn query<T: redis::FromRedisValue>(&self, command: &redis::Cmd) -> Result<T, StoreError> {
        match self {
            Self::Pool(pool) => Ok(command.query_async(&mut pool.get().await?).await?),
            #[cfg(feature = "cluster")]
            Self::Cluster(cluster) => Ok(command.query_async(&mut cluster.clone()).await?),
        }
    }
}

#[cfg(feature = "redis")]
impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pool(pool) => f.debug_tuple("Pool").field(&pool.status()).finish(),
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => f.write_str("Cluster"),
        }
    }
}

/// The in-memory store's data.
#[derive(Debug, Default)]
pub struct Tables {
    stock: HashMap<String, u64>,
    orders: HashMap<String, Order>,
}

impl Store {
    /// An empty in-memory store.
    pub fn memory() -> Self {
        Self::Memory(Arc::default())
    }

    /// A store in the Redis behind `pool`.
    #[cfg(feature = "redis")]
    pub fn redis(pool: deadpool_redis::Pool) -> Self {
        Self::Redis(Remote::Pool(pool))
    }

    /// A store in the Redis Cluster behind `cluster`.
    #[cfg(feature = "cluster")]
    pub fn redis_cluster(cluster: redis::cluster_async::ClusterConnection) -> Self {
        Self::Redis(Remote::Cluster(cluster))
    }

    /// A store in the PostgreSQL database behind `pool`, whose writes check the locks
    /// with `guard` ([`tower_batch_lock::store::Postgres::guard_sql`]): makes its tables.
    #[cfg(feature = "postgres")]
    pub async fn postgres(
        pool: tower_batch_lock::deadpool_postgres::Pool,
        guard: String,
    ) -> Result<Self, StoreError> {
        pool.get()
            .await?
            .batch_execute(
                "CREATE SCHEMA IF NOT EXISTS orders;
                 CREATE TABLE IF NOT EXISTS orders.stock (sku text PRIMARY KEY, qty bigint NOT NULL);
                 CREATE TABLE IF NOT EXISTS orders.orders (order_id text PRIMARY KEY, body text NOT NULL);",
            )
            .await?;
        Ok(Self::Postgres { pool, guard })
    }

    /// The stock levels of `skus`, in one read.
    async fn stock(&self, skus: &[&str]) -> Result<Vec<Option<u64>>, StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, .. } => {
                let rows = pool
                    .get()
                    .await?
                    .query(
                        "SELECT s.qty FROM unnest($1::text[]) WITH ORDINALITY k(sku, i) \
                         LEFT JOIN orders.stock s ON s.sku = k.sku ORDER BY k.i",
                        &[&skus],
                    )
                    .await?;
                let level = |row: &tokio_postgres::Row| row.get::<_, Option<i64>>(0);
                Ok(rows
                    .iter()
                    .map(|row| level(row).and_then(|qty| u64::try_from(qty).ok()))
                    .collect())
            }
            Self::Memory(tables) => {
                let tables = tables.lock().unwrap();
                Ok(skus
                    .iter()
                    .map(|sku| tables.stock.get(*sku).copied())
                    .collect())
            }
            #[cfg(feature = "redis")]
            Self::Redis(remote) => {
                let keys: Vec<String> = skus.iter().map(|sku| stock_key(sku)).collect();
                remote.query(redis::cmd("MGET").arg(keys)).await
            }
        }
    }

    /// Sets a stock level: `false`, and nothing written, as for [`commit`](Self::commit).
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    async fn set_stock(
        &self,
        sku: &str,
        qty: u64,
        lease: Option<&Lease>,
    ) -> Result<bool, StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, guard } => {
                let order = None;
                guarded_write(pool, guard, lease, &[(sku, qty)], order).await
            }
            Self::Memory(tables) => {
                tables.lock().unwrap().stock.insert(sku.to_owned(), qty);
                Ok(true)
            }
            #[cfg(feature = "redis")]
            Self::Redis(remote) => {
                let fence = lease.map(Lease::fencing_token);
                remote
                    .write(&[(stock_key(sku), qty.to_string())], fence)
                    .await
            }
        }
    }

    async fn order(&self, order_id: &str) -> Result<Option<Order>, StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, .. } => {
                let client = pool.get().await?;
                let query = "SELECT body FROM orders.orders WHERE order_id = $1";
                let row = client.query_opt(query, &[&order_id]).await?;
                let json = row.map(|row| row.get::<_, String>(0));
                Ok(json.map(|json| serde_json::from_str(&json)).transpose()?)
            }
            Self::Memory(tables) => Ok(tables.lock().unwrap().orders.get(order_id).cloned()),
            #[cfg(feature = "redis")]
            Self::Redis(remote) => {
                let json: Option<String> = remote
                    .query(redis::cmd("GET").arg(order_key(order_id)))
                    .await?;
                Ok(json.map(|json| serde_json::from_str(&json)).transpose()?)
            }
        }
    }

    /// Writes the new stock levels and the order, in one write: in Redis, fenced by the
    /// order's token (`false`, and nothing written, when a later holder of one of the SKUs
    /// wrote it first); in PostgreSQL, in one transaction that the locks' guard checks
    /// first (`false`, and nothing written, when the order's lease ran out). In memory, the
    /// process that holds the locks holds the data.
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    async fn commit(
        &self,
        stock: &[(&str, u64)],
        order: &Order,
        lease: Option<&Lease>,
    ) -> Result<bool, StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres { pool, guard } => {
                guarded_write(pool, guard, lease, stock, Some(order)).await
            }
            Self::Memory(tables) => {
                let mut tables = tables.lock().unwrap();
                for &(sku, qty) in stock {
                    tables.stock.insert(sku.to_owned(), qty);
                }
                tables.orders.insert(order.order_id.clone(), order.clone());
                Ok(true)
            }
            #[cfg(feature = "redis")]
            Self::Redis(remote) => {
                let mut writes: Vec<(String, String)> = stock
                    .iter()
                    .map(|&(sku, qty)| (stock_key(sku), qty.to_string()))
                    .collect();
                writes.push((order_key(&order.order_id), serde_json::to_string(order)?));
                remote.write(&writes, lease.map(Lease::fencing_token)).await
            }
        }
    }
}

/// Writes stock levels (and an order) in one transaction that first checks, with the
/// locks' guard, that the request still holds `lease`'s keys, and keeps them held until
/// it commits: `false`, and nothing written, when the lease ran out (without a lock, a
/// plain transaction).
#[cfg(feature = "postgres")]
async fn guarded_write(
    pool: &tower_batch_lock::deadpool_postgres::Pool,
    guard: &str,
    lease: Option<&Lease>,
    stock: &[(&str, u64)],
    order: Option<&Order>,
) -> Result<bool, StoreError> {
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    if let Some(lease) = lease {
        let held = lease.postgres_guard();
        if let Err(error) = tx.execute(guard, &[&held.keys, &held.owner]).await {
            if error.code().map(|code| code.code()) == Some("TBL01") {
                return Ok(false);
            }
            return Err(error.into());
        }
    }
    let skus: Vec<&str> = stock.iter().map(|&(sku, _)| sku).collect();
    let levels: Vec<i64> = stock
        .iter()
        .map(|&(_, qty)| i64::try_from(qty))
        .collect::<Result<_, _>>()?;
    tx.execute(
        "INSERT INTO orders.stock (sku, qty) SELECT * FROM unnest($1::text[], $2::bigint[]) \
         ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
        &[&skus, &levels],
    )
    .await?;
    if let Some(order) = order {
        let body = serde_json::to_string(order)?;
        tx.execute(
            "INSERT INTO orders.orders (order_id, body) VALUES ($1, $2)",
            &[&order.order_id, &body],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

#[cfg(feature = "redis")]
fn stock_key(sku: &str) -> String {
    format!("orders:stock:{sku}")
}

#[cfg(feature = "redis")]
fn order_key(order_id: &str) -> String {
    format!("orders:order:{order_id}")
}

/// The comma-separated URLs in the environment variable `name`: at least one.
#[cfg(feature = "redis")]
fn url_list(name: &str) -> Result<Vec<String>, StoreError> {
    let urls: Vec<String> = env::var(name)?
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err(format!("{name} names no Redis").into());
    }
    Ok(urls)
}

/// A pool on the Redis at `url`, checked: fail at start-up, not at the first request, when
/// Redis is not there.
#[cfg(feature = "redis")]
async fn redis_pool(url: &str) -> Result<deadpool_redis::Pool, StoreError> {
    let pool =
        deadpool_redis::Config::from_url(url).create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
    drop(pool.get().await?);
    Ok(pool)
}

/// A duration in milliseconds from the environment, or `default`.
fn env_ms(name: &str, default: u64) -> Result<u64, StoreError> {
    match env::var(name) {
        Ok(ms) => Ok(ms.parse().map_err(|e| format!("{name}: {e}"))?),
        Err(_) => Ok(default),
    }
}

/// The admin port's routes: the metrics in Prometheus's text format, and with the `admin`
/// feature the operator's view of the locks. On a port of its own, never the public one:
/// it names keys, and can force locks open.
fn admin_app(
    metrics: PrometheusHandle,
    #[cfg_attr(not(feature = "admin"), allow(unused_variables))] locks: &Locks,
) -> Router {
    let router = Router::new().route("/metrics", get(move || async move { metrics.render() }));
    #[cfg(feature = "admin")]
    let router = router.nest("/admin", tower_batch_lock::admin::router(locks.clone()));
    router
}

#[tokio::main]
async fn main() -> Result<(), StoreError> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();

    // Before anything records: the layer's metrics, for GET /metrics on the admin port.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let addr = env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let work_delay = Duration::from_millis(env_ms("WORK_DELAY_MS", 0)?);
    let lock_ttl = Duration::from_millis(env_ms("LOCK_TTL_MS", 30_000)?);
    let lock_wait = Duration::from_millis(env_ms("LOCK_WAIT_MS", 0)?);
    let fair = env::var("LOCK_FAIR").map_or(true, |v| v.trim() != "0");
    let stores = [
        "REDIS_URL",
        "REDIS_URLS",
        "REDIS_CLUSTER_URLS",
        "DATABASE_URL",
    ];
    let chosen: Vec<&str> = stores.into_iter().filter(|v| env::var(v).is_ok()).collect();
    if chosen.len() > 1 {
        return Err(format!(
            "set one of {}, not {}",
            stores.join(", "),
            chosen.join(" and ")
        )
        .into());
    }
    let (store, locks, serving) = match chosen.first().copied() {
        None => (
            Store::memory(),
            Locks::memory(),
            "locks and data in memory".to_owned(),
        ),
        #[cfg(feature = "redis")]
        Some("REDIS_URL") => {
            let url = env::var("REDIS_URL")?;
            let pool = redis_pool(&url).await?;
            // The locks get a pool of their own, and a subscription that wakes waiting
            // requests when any instance releases their keys.
            (
                Store::redis(pool),
                Locks::new(tower_batch_lock::store::Redis::url(&url).build()?),
                "locks and data in Redis".to_owned(),
            )
        }
        #[cfg(feature = "redis")]
        Some("REDIS_URLS") => {
            let urls = url_list("REDIS_URLS")?;
            let pool = redis_pool(&urls[0]).await?;
            // Each master gets a pool of its own; the locks hold while a majority answers.
            let locks = Locks::new(tower_batch_lock::store::Redlock::new(&urls).build()?);
            // (No URL in the log: it may carry a password.)
            let serving = format!("locks on {} Redlock masters, data in the first", urls.len());
            (Store::redis(pool), locks, serving)
        }
        #[cfg(feature = "cluster")]
        Some("REDIS_CLUSTER_URLS") => {
            // Any of the nodes: the rest comes from the cluster's slot map.
            let urls = url_list("REDIS_CLUSTER_URLS")?;
            let client = redis::cluster::ClusterClient::new(urls.clone())?;
            let data = client.get_async_connection().await?;
            let locks = Locks::new(tower_batch_lock::store::RedisCluster::new(&urls).build()?);
            let serving = "locks and data on a Redis Cluster".to_owned();
            (Store::redis_cluster(data), locks, serving)
        }
        #[cfg(feature = "postgres")]
        Some("DATABASE_URL") => {
            let url = env::var("DATABASE_URL")?;
            let locks = tower_batch_lock::store::Postgres::url(&url);
            let guard = locks.guard_sql();
            // The locks get a pool of their own, and a connection that listens for
            // releases; the data a pool of its own too, checked now, as for Redis.
            let config: tokio_postgres::Config = url.parse()?;
            let manager =
                tower_batch_lock::deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
            let pool = tower_batch_lock::deadpool_postgres::Pool::builder(manager).build()?;
            let store = Store::postgres(pool, guard).await?;
            let locks = Locks::new(locks.build()?);
            locks.check().await?;
            (store, locks, "locks and data in PostgreSQL".to_owned())
        }
        Some(other) => {
            return Err(format!(
                "{other} is set, but this build has no store for it: add `--features redis` \
                 (`--features cluster` for REDIS_CLUSTER_URLS, `--features postgres` for \
                 DATABASE_URL)"
            )
            .into())
        }
    };
    let locks = locks
        .ttl(lock_ttl)
        .renew_lease(true)
        .wait(Wait::up_to(lock_wait).fair(fair));

    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(
        "orders listening on http://{}, {serving}",
        listener.local_addr()?
    );
    let admin_addr = env::var("ADMIN_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let admin_listener = tokio::net::TcpListener::bind(&admin_addr).await?;
    tracing::info!("admin (metrics) on http://{}", admin_listener.local_addr()?);
    let admin = admin_app(metrics, &locks);
    tokio::spawn(async move { axum::serve(admin_listener, admin).await });
    axum::serve(listener, app(store, Some(locks), work_delay))
        // In-flight orders finish and release their locks before the process exits.
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
