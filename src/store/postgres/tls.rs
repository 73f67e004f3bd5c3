//! How the store opens connections: without TLS, or with the user's connector. One choice
//! for the pool the store makes from a URL and for the connection that listens for
//! releases, which no pool makes.

use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig};
use futures_util::{future::BoxFuture, stream::BoxStream, StreamExt};
use tokio_postgres::{
    tls::{MakeTlsConnect, TlsConnect},
    AsyncMessage, Client, Config, Error, Socket,
};

/// What the server sends a connection unasked (notifications, notices), until it closes.
pub(super) type Messages = BoxStream<'static, Result<AsyncMessage, Error>>;

/// A connection being opened: its client, and its [`Messages`].
type Connecting = BoxFuture<'static, Result<(Client, Messages), Error>>;

/// A connector, with its type erased: the builder and the store stay free of it.
#[derive(Clone)]
pub(super) struct Connector {
    manager: Arc<dyn Fn(Config, ManagerConfig) -> Manager + Send + Sync>,
    connect: Arc<dyn Fn(Config) -> Connecting + Send + Sync>,
}

impl Connector {
    /// Connects with `tls` (`tokio_postgres::NoTls`, or a TLS connector).
    pub(super) fn new<T>(tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let for_pool = tls.clone();
        Self {
            manager: Arc::new(move |config, manager| {
                Manager::from_config(config, for_pool.clone(), manager)
            }),
            connect: Arc::new(move |config| {
                let tls = tls.clone();
                Box::pin(async move {
                    let (client, mut connection) = config.connect(tls).await?;
                    let messages =
                        futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    Ok((client, messages.boxed()))
                })
            }),
        }
    }

    /// The manager of a pool of connections to `config`.
    pub(super) fn manager(&self, config: Config, manager: ManagerConfig) -> Manager {
        (self.manager)(config, manager)
    }

    /// A connection of its own to `config`: its client, and what the server sends it
    /// unasked, which must be polled for the client's statements to run.
    pub(super) fn connect(&self, config: Config) -> Connecting {
        (self.connect)(config)
    }
}
