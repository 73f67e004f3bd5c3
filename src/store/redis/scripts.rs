//! The Lua scripts, one file each under `scripts/`, loaded into Redis as one function
//! library per topology (`FUNCTION LOAD`) and called with `FCALL`: the prelude of the
//! topology, the clock and fencing counter's functions and the value format's are built
//! once, when the library loads, where a script sent with `EVALSHA` builds them again on
//! every call (a sixth of Redis's time for a one-key acquire and release, in the bench).
//!
//! A library's name carries a hash of its source, so that processes of two versions of the
//! crate (a rolling upgrade) each call their own functions on the same Redis, over the same
//! values. A call to a function that the server does not have (after a restart without
//! persistence, a `FUNCTION FLUSH`, or on a server that never had it) loads the library and
//! runs again.

use std::{fmt::Write as _, sync::LazyLock};

use redis::{aio::ConnectionLike, FromRedisValue, RedisError, RedisResult, ToRedisArgs};

/// Redis's clock, and the fencing counter that never counts below it.
const CLOCK: &str = include_str!("scripts/clock.lua");

/// The registry of the claims of waiters with big batches (`claims.lua`), and the start of
/// each claim's key, on one Redis and each Redlock master: outside every lock namespace
/// (`Locks::prefix` refuses one that could reach [`OWN_NAMES`](crate::store::OWN_NAMES)).
/// A cluster node's registry is this with a hash tag of one of its slots
/// (`cluster/topology.rs`).
pub(crate) const CLAIMS: &str = "tower-batch-lock:claims";

/// The functions of one library: the scripts that read or write lock values, each behind
/// its topology's prelude (`single.lua` or `cluster.lua`: where the keys come from, and
/// what a node may do with them), the clock's and the fencing counter's functions
/// (`clock.lua`), the value format's (`value.lua`) and the claims' (`claims.lua`).
pub(crate) struct Scripts {
    /// The library's source, for `FUNCTION LOAD`.
    library: String,
    /// Locks a batch, all or nothing, or reserves it for a waiter in line.
    pub(super) acquire: Function,
    /// Finds how many of the keys that kept a waiter out no longer do, writing nothing.
    pub(super) probe: Function,
    /// Extends a batch if every key still has the hold.
    pub(super) extend: Function,
    /// Ends a hold on the keys that still have it, and announces the release.
    pub(super) release: Function,
    /// Takes a waiter's reservations off its keys, and announces it.
    pub(super) withdraw: Function,
    /// Reads what an operator may see of keys: state, ttl, holds, waiters; never owners.
    pub(super) inspect: Function,
    /// Ends every hold on keys, whoever has it, and announces it.
    pub(super) force_release: Function,
    /// Puts a waiter's reservation on keys (the keys of a refused batch that a cluster
    /// group or an earlier step took).
    pub(super) reserve: Function,
    /// Puts a waiter's big batch in its claim without reading its keys, once a probe found
    /// one held (`steps.rs`).
    pub(super) join_line: Function,
    /// Raises a namespace's fencing counter to a floor (for Redlock).
    pub(super) raise_fence: Function,
    /// Whether the keys go as arguments (a group of a batch on a cluster node) rather than
    /// as declared keys.
    pub(super) keys_as_args: bool,
}

/// A function of a library, by its name in Redis.
pub(crate) struct Function {
    name: String,
}

impl Scripts {
    /// The library of `prelude`'s topology. `cross_slot`: whether its functions touch keys
    /// of several slots of a cluster node (which Redis allows only to functions that say
    /// so).
    fn library(prelude: &str, keys_as_args: bool, cross_slot: bool) -> Self {
        // Each function's body, and the flags Redis checks before it runs: the ones that
        // free memory or only read run when Redis is out of memory, as their commands (DEL,
        // PEXPIRE, reads) did from a script without flags; the ones that may add keys
        // are refused then, as their SET would have been.
        let bodies = [
            ("acquire", include_str!("scripts/acquire.lua"), ""),
            ("probe", include_str!("scripts/probe.lua"), "no-writes"),
            ("extend", include_str!("scripts/extend.lua"), "allow-oom"),
            ("release", include_str!("scripts/release.lua"), "allow-oom"),
            (
                "withdraw",
                include_str!("scripts/withdraw.lua"),
                "allow-oom",
            ),
            ("inspect", include_str!("scripts/inspect.lua"), "no-writes"),
            (
                "force_release",
                include_str!("scripts/force_release.lua"),
                "allow-oom",
            ),
            ("reserve", include_str!("scripts/reserve.lua"), ""),
            ("join_line", include_str!("scripts/join_line.lua"), ""),
            ("raise_fence", include_str!("scripts/raise_fence.lua"), ""),
        ];
        let mut code = [
            "-- The call's keys and arguments, which each function sets (below).\n",
            "local KEYS, ARGV\n",
            "-- The claims registry (claims.lua): one Redis's; a cluster node's call names its own.\n",
            &format!("local CLAIMS = '{CLAIMS}'\n"),
            prelude,
            CLOCK,
            include_str!("scripts/value.lua"),
            include_str!("scripts/claims.lua"),
        ]
        .concat();
        for (name, body, _) in bodies {
            let _ = write!(code, "local function {name}()\n{body}\nend\n");
        }
        code.push_str(include_str!("scripts/library.lua"));
        for (name, _, flag) in bodies {
            let flags = [
                flag,
                if cross_slot {
                    "allow-cross-slot-keys"
                } else {
                    ""
                },
            ]
            .iter()
            .filter(|flag| !flag.is_empty())
            .map(|flag| format!("'{flag}'"))
            .collect::<Vec<_>>()
            .join(", ");
            let _ = writeln!(code, "register('{name}', {name}, {{{flags}}})");
        }
        // Named after a hash of everything else, the flags included.
        let hash = sha1_smol::Sha1::from(&code).digest().to_string();
        let prefix = format!("tower_batch_lock_{}", &hash[..12]);
        let function = |name: &str| Function {
            name: format!("{prefix}_{name}"),
        };
        Self {
            library: format!("#!lua name={prefix}\nlocal PREFIX = '{prefix}_'\n{code}"),
            acquire: function("acquire"),
            probe: function("probe"),
            extend: function("extend"),
            release: function("release"),
            withdraw: function("withdraw"),
            inspect: function("inspect"),
            force_release: function("force_release"),
            reserve: function("reserve"),
            join_line: function("join_line"),
            raise_fence: function("raise_fence"),
            keys_as_args,
        }
    }

    /// Whether the acquire script counts a grant (one Redis, a Redlock master), or a
    /// cluster node's leaves that to the cluster store (cluster.lua), and takes a
    /// placeholder for the counter.
    pub(super) fn counts_grants(&self) -> bool {
        !self.keys_as_args
    }

    /// A call of `function` (one of these) on `keys`, after `lead`, a key that goes first
    /// when given (the acquire script's counter). `claims`: the claims registry of the
    /// node, which a cluster node's call names (one Redis's is in the library).
    pub(super) fn prepare(
        &'static self,
        function: &Function,
        claims: &str,
        lead: Option<&str>,
        keys: &[String],
    ) -> Invocation {
        let count = keys.len() + usize::from(lead.is_some());
        let mut command = redis::cmd("FCALL");
        command.arg(&function.name);
        if self.keys_as_args {
            command.arg(0).arg(claims);
        }
        command.arg(count);
        if let Some(lead) = lead {
            command.arg(lead);
        }
        command.arg(keys);
        Invocation {
            command,
            scripts: self,
        }
    }

    /// Loads the library where it is not: a library of the same name is this very one.
    pub(super) async fn load(&self, connection: &mut impl ConnectionLike) -> RedisResult<()> {
        let loaded = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(&self.library)
            .query_async::<redis::Value>(connection)
            .await;
        match loaded {
            Err(error) if detail(&error).is_some_and(|d| d.ends_with("already exists")) => Ok(()),
            loaded => loaded.map(drop),
        }
    }
}

/// One call of a function, its arguments added with [`arg`](Self::arg).
pub(crate) struct Invocation {
    command: redis::Cmd,
    scripts: &'static Scripts,
}

impl Invocation {
    /// Adds an argument after the keys.
    pub(super) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.command.arg(arg);
        self
    }

    /// Runs the call on `connection`: once more after loading the library, if the server
    /// does not have the function.
    pub(super) async fn invoke<T: FromRedisValue>(
        &self,
        connection: &mut impl ConnectionLike,
    ) -> RedisResult<T> {
        match self.command.query_async(connection).await {
            Err(error) if detail(&error) == Some("Function not found") => {
                self.scripts.load(connection).await?;
                self.command.query_async(connection).await
            }
            reply => reply,
        }
    }
}

/// The text of an `ERR` answer.
fn detail(error: &RedisError) -> Option<&str> {
    (error.code() == Some("ERR"))
        .then(|| error.detail())
        .flatten()
}

/// The library on one Redis, and on each Redlock master.
pub(super) static SINGLE: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::library(include_str!("scripts/single.lua"), false, false));

/// The library on a Redis Cluster node, for the keys of a batch that the node serves.
#[cfg(feature = "cluster")]
pub(super) static CLUSTER: LazyLock<Scripts> =
    LazyLock::new(|| Scripts::library(include_str!("scripts/cluster.lua"), true, true));

/// Counts a grant in a namespace's fencing counter, apart from any batch: the cluster
/// store's token, on the counter's master through the cluster connection (which routes a
/// command by its key, and would send `FUNCTION LOAD` to every master). Its source, for
/// `EVAL` where a node does not have it cached.
#[cfg(feature = "cluster")]
pub(crate) static COUNT_GRANT_SOURCE: LazyLock<String> =
    LazyLock::new(|| [CLOCK, include_str!("scripts/count_grant.lua")].concat());

/// [`COUNT_GRANT_SOURCE`], for its hash (`EVALSHA`).
#[cfg(feature = "cluster")]
pub(crate) static COUNT_GRANT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(&COUNT_GRANT_SOURCE));
