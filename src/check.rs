//! What [`Locks::check`](crate::Locks::check) reports.

use std::fmt;

/// The lock store cannot serve locks: it did not answer within the backend timeout, or it
/// lacks what the locks need (for example, a Redis older than 7.0, or a majority of the
/// Redlock masters). The message says which; it may name servers, not credentials.
#[derive(Debug)]
pub struct CheckError {
    detail: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl CheckError {
    pub(crate) fn new(
        detail: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            detail: detail.into(),
            source,
        }
    }
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|s| s as _)
    }
}
