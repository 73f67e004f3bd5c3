//! The one error for "the lock store failed".

use std::{borrow::Cow, error::Error, fmt, time::Duration};

use http::StatusCode;

type Source = Box<dyn Error + Send + Sync>;

/// The lock store failed: it did not answer in time, could not be reached, or answered
/// with an error; or it lacks what the locks need (for example, a Redis older than 7.0, or
/// a majority of the Redlock masters). The message says which, and may name servers,
/// never credentials.
///
/// Requests never see it: they get a 503 ([`Rejection`](crate::Rejection)) and the error
/// is logged. [`Locks::check`](crate::Locks::check) returns it, for a readiness probe or
/// a start-up check.
#[derive(Debug)]
pub struct StoreError {
    /// What failed, in this crate's words: the first part of the message.
    context: Cow<'static, str>,
    source: Option<Source>,
    /// Whether the store may have carried out the command before failing, so that the
    /// caller has to clean up after itself.
    may_have_applied: bool,
    /// Whether a part of a waiter's attempt that got no answer may still put its place in
    /// line back later, which the waiter alone can withdraw.
    may_reserve_later: bool,
}

// The memory store never fails, so without the `redis` feature only timeouts build these.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl StoreError {
    /// The command never reached the store (for example, no connection could be made).
    pub(crate) fn not_sent(source: impl Into<Source>) -> Self {
        Self::from_source(source, false)
    }

    /// The call failed, and left nothing for its caller to undo: it only reads, or it undid
    /// (or is undoing) what it wrote, as a refused or failed batch does on every node.
    pub(crate) fn left_nothing(source: impl Into<Source>) -> Self {
        Self::from_source(source, false)
    }

    /// A waiter's attempt failed and undid (or is undoing) what it took, but a part of it
    /// that got no answer may still run later and put the waiter's place in line back:
    /// the waiter withdraws its place again then ([`late`](crate::store::late)). A cluster
    /// attempt whose group on one master got no answer; a failed Redlock attempt that a
    /// master did not answer.
    #[cfg(feature = "redis")]
    pub(crate) fn left_place(source: impl Into<Source>) -> Self {
        Self {
            may_reserve_later: true,
            ..Self::from_source(source, false)
        }
    }

    /// The command was sent, and its effect is unknown.
    pub(crate) fn unknown(source: impl Into<Source>) -> Self {
        Self::from_source(source, true)
    }

    /// No answer within `timeout`: the command may still run.
    pub(crate) fn timed_out(timeout: Duration) -> Self {
        Self {
            context: format!(
                "the lock store did not answer within {} ms",
                timeout.as_millis()
            )
            .into(),
            source: None,
            may_have_applied: true,
            may_reserve_later: true,
        }
    }

    fn from_source(source: impl Into<Source>, may_have_applied: bool) -> Self {
        Self {
            context: Cow::Borrowed("lock store error"),
            source: Some(source.into()),
            may_have_applied,
            may_reserve_later: may_have_applied,
        }
    }

    /// The same error, said of what the caller was doing: `context` replaces the first
    /// part of the message.
    pub(crate) fn context(mut self, context: impl Into<Cow<'static, str>>) -> Self {
        self.context = context.into();
        self
    }

    /// Whether the store may have carried out the command before failing.
    pub(crate) fn may_have_applied(&self) -> bool {
        self.may_have_applied
    }

    /// Whether a waiter's failed attempt may still put its place in line back later
    /// (every attempt that may have applied may).
    pub(crate) fn may_reserve_later(&self) -> bool {
        self.may_reserve_later
    }

    /// The status a client gets for it: `503 Service Unavailable`.
    pub fn status(&self) -> StatusCode {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl Error for StoreError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|s| s as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_says_what_failed_and_why() {
        let error = StoreError::not_sent("connection refused").context("checking the store");
        assert_eq!(error.to_string(), "checking the store: connection refused");
        assert!(!error.may_have_applied() && !error.may_reserve_later());
        let error = StoreError::timed_out(Duration::from_millis(250));
        assert_eq!(
            error.to_string(),
            "the lock store did not answer within 250 ms"
        );
        assert!(error.may_have_applied());
        assert!(
            error.may_reserve_later(),
            "a waiter's attempt that timed out"
        );
        assert_eq!(error.status(), StatusCode::SERVICE_UNAVAILABLE);
        // A cluster or Redlock attempt that undid its grants, with a part that never
        // answered.
        #[cfg(feature = "redis")]
        {
            let error = StoreError::left_place("no answer from one master");
            assert!(!error.may_have_applied() && error.may_reserve_later());
        }
    }
}
