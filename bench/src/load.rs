//! A small HTTP/1.1 load generator: C keep-alive connections over loopback, each sending
//! one request after the other, until a time limit or a request count is reached; and
//! single requests on a connection of their own.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// Longest a single request may take before the run counts it as an error and stops that
/// connection.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub(crate) path: String,
    pub(crate) requests: Requests,
    pub(crate) connections: usize,
    pub(crate) duration: Duration,
    pub(crate) max_requests: u64,
}

/// What each request of a [`Load`] sends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Requests {
    /// A GET naming a key of its own in `x-key` (uncontended).
    OwnKey,
    /// A GET naming the same key as every other (contended).
    SharedKey,
    /// A POST of a JSON body, a new one from this function for each request.
    Json(fn() -> String),
}

#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) elapsed: Duration,
    /// Every answered request's latency, unsorted.
    pub(crate) latencies: Vec<Duration>,
    pub(crate) statuses: BTreeMap<u16, u64>,
    /// Requests that failed at the transport level (connection refused, reset, timeout).
    pub(crate) errors: u64,
}

impl Outcome {
    pub(crate) fn requests(&self) -> u64 {
        self.latencies.len() as u64
    }

    pub(crate) fn per_second(&self) -> f64 {
        self.requests() as f64 / self.elapsed.as_secs_f64()
    }
}

/// Drives `load` against `addr`; `on_tick` hears the requests answered so far, a few
/// times a second.
pub(crate) async fn drive(addr: SocketAddr, load: Load, on_tick: impl Fn(u64)) -> Outcome {
    let issued = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + load.duration;
    let load = Arc::new(load);
    let connections: Vec<_> = (0..load.connections)
        .map(|connection| {
            let (load, issued, answered) = (load.clone(), issued.clone(), answered.clone());
            tokio::spawn(async move {
                connection_loop(addr, connection, &load, deadline, &issued, &answered).await
            })
        })
        .collect();
    let ticker = async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            on_tick(answered.load(Ordering::Relaxed));
        }
    };
    let joined = futures_join(connections);
    tokio::pin!(joined);
    let outcomes = tokio::select! {
        outcomes = &mut joined => outcomes,
        () = ticker => unreachable!("the ticker never ends"),
    };
    let mut total = Outcome {
        elapsed: started.elapsed(),
        ..Outcome::default()
    };
    for outcome in outcomes {
        total.latencies.extend(outcome.latencies);
        total.errors += outcome.errors;
        for (status, n) in outcome.statuses {
            *total.statuses.entry(status).or_default() += n;
        }
    }
    total
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<Outcome>>) -> Vec<Outcome> {
    let mut outcomes = Vec::with_capacity(handles.len());
    for handle in handles {
        outcomes.push(handle.await.unwrap_or_else(|_| Outcome {
            errors: 1,
            ..Outcome::default()
        }));
    }
    outcomes
}

async fn connection_loop(
    addr: SocketAddr,
    connection: usize,
    load: &Load,
    deadline: Instant,
    issued: &AtomicU64,
    answered: &AtomicU64,
) -> Outcome {
    let mut outcome = Outcome::default();
    let Ok(stream) = TcpStream::connect(addr).await else {
        outcome.errors += 1;
        return outcome;
    };
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut line = String::new();
    let mut body = Vec::new();
    for sequence in 0u64.. {
        if Instant::now() >= deadline || issued.fetch_add(1, Ordering::Relaxed) >= load.max_requests
        {
            break;
        }
        let request = match load.requests {
            Requests::OwnKey => get(&load.path, &format!("c{connection}-{sequence}")),
            Requests::SharedKey => get(&load.path, "shared"),
            Requests::Json(body) => post_json(&load.path, &body()),
        };
        let sent = Instant::now();
        let exchange = async {
            write.write_all(request.as_bytes()).await?;
            read_response(&mut read, &mut line, &mut body).await
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
            Ok(Ok(status)) => {
                outcome.latencies.push(sent.elapsed());
                *outcome.statuses.entry(status).or_default() += 1;
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(_)) | Err(_) => {
                outcome.errors += 1;
                break;
            }
        }
    }
    outcome
}

fn get(path: &str, key: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: bench\r\nx-key: {key}\r\n\r\n")
}

pub(crate) fn post_json(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `request` on a connection of its own, within `timeout`, and returns when it went
/// out (once connected, so that the connection's setup is not counted) and the status.
pub(crate) async fn once(
    addr: SocketAddr,
    request: &str,
    timeout: Duration,
) -> std::io::Result<(Instant, u16)> {
    let exchange = async {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, mut write) = stream.into_split();
        let sent = Instant::now();
        write.write_all(request.as_bytes()).await?;
        let status = read_response(
            &mut BufReader::new(read),
            &mut String::new(),
            &mut Vec::new(),
        )
        .await?;
        Ok((sent, status))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"))?
}

/// Reads one response and returns its status; the body is read and dropped.
async fn read_response<R: AsyncBufReadExt + Unpin>(
    read: &mut R,
    line: &mut String,
    body: &mut Vec<u8>,
) -> std::io::Result<u16> {
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    line.clear();
    if read.read_line(line).await? == 0 {
        return Err(invalid("connection closed"));
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid("bad status line"))?;
    let (mut length, mut chunked) = (0usize, false);
    loop {
        line.clear();
        if read.read_line(line).await? == 0 {
            return Err(invalid("connection closed in the head"));
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = value.parse().map_err(|_| invalid("bad content-length"))?;
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            }
        }
    }
    if !chunked {
        body.resize(length, 0);
        read.read_exact(body).await?;
        return Ok(status);
    }
    loop {
        line.clear();
        read.read_line(line).await?;
        let size = usize::from_str_radix(line.trim_end().split(';').next().unwrap_or(""), 16)
            .map_err(|_| invalid("bad chunk size"))?;
        // The chunk and its CRLF; the last chunk is followed by the final CRLF alone.
        body.resize(size + 2, 0);
        read.read_exact(body).await?;
        if size == 0 {
            return Ok(status);
        }
    }
}
