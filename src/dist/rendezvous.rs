//! The rendezvous of a process group: rank 0 sends a small payload (NCCL's unique id) to every
//! other rank over TCP on `MASTER_ADDR:MASTER_PORT`, with a deadline on every step so that a
//! missing or dead rank gives an error instead of a hang.
//!
//! Protocol: each rank `r > 0` connects to rank 0 (retrying until the deadline) and sends
//! `MAGIC, r, world_size` as three little-endian u32; rank 0 checks them (the world size agrees,
//! no rank twice) and answers with the payload.

use super::DistEnv;
use candle_core::{bail, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x4653_4f50; // "FSOP"

/// The rendezvous deadline: `FASTOPS_DIST_TIMEOUT_S` seconds, 120 by default.
pub fn timeout_from_env() -> Duration {
    let secs = std::env::var("FASTOPS_DIST_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(120);
    Duration::from_secs(secs)
}

fn io_err(what: &str, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("dist rendezvous: {what}: {e}"))
}

/// Rank 0 passes `Some(payload)` and gets it back once every other rank has received it; the
/// other ranks pass `None` and get rank 0's payload of `len` bytes. Fails after `timeout`.
pub fn share_from_rank0(
    env: &DistEnv, payload: Option<&[u8]>, len: usize, timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    if env.rank == 0 {
        let Some(payload) = payload else {
            bail!("dist rendezvous: rank 0 must pass the payload")
        };
        if payload.len() != len {
            bail!(
                "dist rendezvous: payload of {} bytes, expected {len}",
                payload.len()
            );
        }
        if env.world_size > 1 {
            serve(&addr, env.world_size, payload, deadline)?;
        }
        return Ok(payload.to_vec());
    }
    fetch(&addr, env, len, deadline)
}

fn serve(addr: &str, world_size: usize, payload: &[u8], deadline: Instant) -> Result<()> {
    let listener = TcpListener::bind(addr).map_err(|e| io_err(&format!("bind {addr}"), e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| io_err("listener", e))?;
    let mut seen = vec![false; world_size];
    seen[0] = true;
    let mut served = 1;
    while served < world_size {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| io_err("accept", e))?;
                let left = deadline.saturating_duration_since(Instant::now());
                let left = left.max(Duration::from_millis(10));
                stream
                    .set_read_timeout(Some(left))
                    .and_then(|_| stream.set_write_timeout(Some(left)))
                    .map_err(|e| io_err("accept", e))?;
                let mut header = [0u8; 12];
                stream
                    .read_exact(&mut header)
                    .map_err(|e| io_err("reading a rank's hello", e))?;
                let word =
                    |i: usize| u32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
                let (magic, rank, world) = (word(0), word(1) as usize, word(2) as usize);
                if magic != MAGIC {
                    bail!(
                        "dist rendezvous: a connection to {addr} that is not a rank of this group"
                    );
                }
                if world != world_size {
                    bail!(
                        "dist rendezvous: rank {rank} has WORLD_SIZE {world}, rank 0 has {world_size}"
                    );
                }
                if rank == 0 || rank >= world_size || seen[rank] {
                    bail!("dist rendezvous: rank {rank} joined twice or is out of range (WORLD_SIZE {world_size})");
                }
                stream
                    .write_all(payload)
                    .map_err(|e| io_err(&format!("sending to rank {rank}"), e))?;
                seen[rank] = true;
                served += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (0..world_size).filter(|r| !seen[*r]).collect();
                    bail!(
                        "dist rendezvous: ranks {missing:?} did not join {addr} in time \
                         (FASTOPS_DIST_TIMEOUT_S)"
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(io_err("accept", e)),
        }
    }
    Ok(())
}

fn fetch(addr: &str, env: &DistEnv, len: usize, deadline: Instant) -> Result<Vec<u8>> {
    let target = addr
        .to_socket_addrs()
        .map_err(|e| io_err(&format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("dist rendezvous: {addr} resolves to nothing"))
        })?;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!(
                "dist rendezvous: rank {} could not reach rank 0 at {addr} in time \
                 (FASTOPS_DIST_TIMEOUT_S)",
                env.rank
            );
        }
        match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream
        .set_read_timeout(Some(left))
        .and_then(|_| stream.set_write_timeout(Some(left)))
        .map_err(|e| io_err("connect", e))?;
    let mut header = Vec::with_capacity(12);
    for w in [MAGIC, env.rank as u32, env.world_size as u32] {
        header.extend_from_slice(&w.to_le_bytes());
    }
    stream
        .write_all(&header)
        .map_err(|e| io_err("sending the hello", e))?;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).map_err(|e| {
        io_err(
            &format!(
                "rank {} receiving from rank 0 (did rank 0 reject it?)",
                env.rank
            ),
            e,
        )
    })?;
    Ok(payload)
}
