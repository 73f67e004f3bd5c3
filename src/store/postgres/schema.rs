//! The names the PostgreSQL store's objects go by, the SQL that makes them
//! (`schema.sql`), and the check on first use that they are there, in this version.

use deadpool_postgres::Client;
use tokio_postgres::error::SqlState;

use super::failure::failed;
use crate::store::error::StoreError;

/// The version of `schema.sql` this crate calls (its `_version()` function answers it).
pub(super) const VERSION: i32 = 1;

/// The oldest PostgreSQL the functions run on (`server_version_num`).
const OLDEST_SERVER: i32 = 120_000;

/// Where the store's objects live: the table `schema.table`, and beside it, in the same
/// schema, its sequence, its answers table and its functions, all named after the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Names {
    pub(super) schema: String,
    pub(super) table: String,
}

impl Names {
    /// Whether `name` can name a schema or a table here: a lowercase SQL identifier that
    /// needs no quoting, short enough for the longest name derived from it (PostgreSQL
    /// cuts identifiers at 63 bytes).
    pub(super) fn valid(name: &str) -> bool {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && name.len() <= 40
    }

    /// Panics unless [`channel`](Self::channel) fits in a PostgreSQL identifier (63 bytes):
    /// `pg_notify` refuses a longer channel, which would fail every release that wakes a
    /// waiter, and `LISTEN` cuts it, which would hear nothing.
    pub(super) fn assert_fits(&self) {
        let channel = self.channel();
        assert!(
            channel.len() <= 63,
            "schema and table name too long together: {channel:?} is {} bytes, the limit 63",
            channel.len()
        );
    }

    /// `schema.table`: the table, and the stem of every object beside it.
    pub(super) fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The channel of release notifications: one per table, so that stores on other tables
    /// of the same database wake nobody here.
    pub(super) fn channel(&self) -> String {
        self.qualified()
    }

    /// The SQL that makes (or completes) the schema, for those who run their own
    /// migrations; idempotent.
    pub(super) fn sql(&self) -> String {
        include_str!("schema.sql")
            .replace("{S}", &self.schema)
            .replace("{T}", &self.qualified())
            .replace("{C}", &self.channel())
    }

    /// The call of the function `name` of the schema on `args`, as a statement.
    pub(super) fn call(&self, columns: &str, name: &str, args: &str) -> String {
        format!("SELECT {columns} FROM {}_{name}({args})", self.qualified())
    }
}

/// Makes sure the schema is there, in [`VERSION`]: makes it when `create` allows and it is
/// missing (several processes at once make it once, under an advisory lock); otherwise
/// says what is wrong.
pub(super) async fn prepare(
    client: &Client,
    names: &Names,
    create: bool,
) -> Result<(), StoreError> {
    let server = number(client, "SELECT current_setting('server_version_num')::int")
        .await
        .map_err(|e| failed(e, false))?
        .unwrap_or(0);
    if server < OLDEST_SERVER {
        return Err(StoreError::left_nothing(format!(
            "the lock store needs PostgreSQL 12 or later; this server is {server}"
        )));
    }
    let version = format!("SELECT {}_version()", names.qualified());
    let found = match number(client, &version).await {
        Ok(found) => found,
        Err(error)
            if matches!(
                error.code(),
                Some(&SqlState::UNDEFINED_FUNCTION | &SqlState::INVALID_SCHEMA_NAME)
            ) =>
        {
            None
        }
        Err(error) => return Err(failed(error, false)),
    };
    match found {
        Some(VERSION) => Ok(()),
        Some(other) => Err(StoreError::left_nothing(format!(
            "the lock table {} has schema version {other}; this version of the crate \
             needs version {VERSION}",
            names.qualified()
        ))),
        None if create => {
            // One transaction (a simple query of several statements is one), under a lock
            // that lets one process make the schema while the others wait, then find it.
            let install = format!(
                "SELECT pg_advisory_xact_lock(hashtext('tower-batch-lock {}'));\n{}",
                names.qualified(),
                names.sql()
            );
            client
                .batch_execute(&install)
                .await
                .map_err(|e| failed(e, false))
        }
        None => Err(StoreError::left_nothing(format!(
            "the lock table {} is missing, and the store may not make it: run the SQL of \
             `Postgres::schema_sql` first",
            names.qualified()
        ))),
    }
}

/// The number `sql` selects, sent unprepared in one round trip, as every statement must be
/// behind a pooler in transaction mode.
async fn number(client: &Client, sql: &str) -> Result<Option<i32>, tokio_postgres::Error> {
    Ok(client
        .query_typed(sql, &[])
        .await?
        .first()
        .map(|row| row.get(0)))
}
