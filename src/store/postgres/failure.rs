//! What a failed PostgreSQL call tells the request path.

use crate::store::error::StoreError;

/// The store's error for a failed call. An error the server answered rolled the call's
/// statement back, so it left nothing; any other (a connection lost while it ran) may
/// have applied when `writes`.
pub(super) fn failed(error: tokio_postgres::Error, writes: bool) -> StoreError {
    // tokio-postgres shows a server's error as "db error" alone: the code and message say
    // what it was.
    match error.as_db_error() {
        Some(db) => StoreError::left_nothing(format!(
            "PostgreSQL answered {}: {}",
            db.code().code(),
            db.message()
        )),
        None if writes => StoreError::unknown(error),
        None => StoreError::left_nothing(error),
    }
}
