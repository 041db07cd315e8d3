//! [`DistEnv`] (the torchrun-style environment) and [`launch`] (one process per GPU).

use candle_core::{bail, Result};
use std::process::{Child, Command};
use std::time::Duration;

/// A rank's place in a process group, as torchrun passes it: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
/// (the GPU this process uses), `MASTER_ADDR` and `MASTER_PORT` (where rank 0 listens for the
/// rendezvous).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// This process's rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// The number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// The GPU of this process on its host (`LOCAL_RANK`; `RANK` when unset).
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous (`MASTER_ADDR`; 127.0.0.1 when unset).
    pub master_addr: String,
    /// Its port (`MASTER_PORT`; required for more than one rank).
    pub master_port: u16,
}

impl DistEnv {
    /// A single process: rank 0 of 1 on GPU 0 (no rendezvous happens).
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
        }
    }

    /// Reads the process environment: `None` when neither `RANK` nor `WORLD_SIZE` is set, an
    /// error when they are set but incomplete or inconsistent.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`DistEnv::from_env`], reading the variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        if get("RANK").is_none() && get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let number = |name: &str| -> Result<usize> {
            let Some(text) = get(name) else {
                bail!("dist: {name} is not set (RANK and WORLD_SIZE are)")
            };
            text.trim().parse::<usize>().map_err(|_| {
                candle_core::Error::Msg(format!("dist: {name}={text:?} is not a number"))
            })
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => number("LOCAL_RANK")?,
            None => rank,
        };
        if world_size == 0 || rank >= world_size {
            bail!("dist: RANK {rank} is not below WORLD_SIZE {world_size}");
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match get("MASTER_PORT") {
            Some(p) => p.trim().parse::<u16>().map_err(|_| {
                candle_core::Error::Msg(format!("dist: MASTER_PORT={p:?} is not a port"))
            })?,
            None if world_size == 1 => 0,
            None => bail!("dist: MASTER_PORT is not set (WORLD_SIZE {world_size})"),
        };
        Ok(Some(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }
}

/// torchrun for this program: called at the start of `main`, it returns this process's
/// [`DistEnv`] when it is a rank (the environment names one, or `nprocs` is 1), and otherwise
/// starts `nprocs` copies of the running program with the same arguments, one per GPU (`RANK` =
/// `LOCAL_RANK` = 0..nprocs, `MASTER_ADDR` 127.0.0.1 and a free `MASTER_PORT`;
/// `NCCL_NVLS_ENABLE=0` unless already set), waits for them and returns `None` once all have
/// exited successfully. When one rank fails the others are stopped and the error names it.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// let Some(env) = candle_fastops::dist::launch(2)? else {
///     return Ok(()); // the launcher: every rank finished
/// };
/// // a rank: build the process group (`NcclGroup::from_env(&env)` with the `nccl` feature)
/// # let _ = env; Ok(()) }
/// ```
pub fn launch(nprocs: usize) -> Result<Option<DistEnv>> {
    if let Some(env) = DistEnv::from_env()? {
        return Ok(Some(env));
    }
    if nprocs <= 1 {
        return Ok(Some(DistEnv::single()));
    }
    let exe = std::env::current_exe().map_err(|e| candle_core::Error::Msg(format!("dist: {e}")))?;
    let port = free_port()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::with_capacity(nprocs);
    for rank in 0..nprocs {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nprocs.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                stop_all(&mut children);
                bail!("dist: starting rank {rank} ({}): {e}", exe.display());
            }
        }
    }
    let mut done = vec![false; nprocs];
    loop {
        for rank in 0..nprocs {
            if done[rank] {
                continue;
            }
            let status = children[rank].try_wait().map_err(|e| {
                candle_core::Error::Msg(format!("dist: waiting for rank {rank}: {e}"))
            })?;
            if let Some(status) = status {
                if !status.success() {
                    stop_all(&mut children);
                    bail!("dist: rank {rank} failed ({status}); stopped the other ranks");
                }
                done[rank] = true;
            }
        }
        if done.iter().all(|d| *d) {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        let _ = child.kill();
    }
    for child in children.iter_mut() {
        let _ = child.wait();
    }
}

/// A TCP port free on the loopback now (the OS picks it).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| candle_core::Error::Msg(format!("dist: no free port: {e}")))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| candle_core::Error::Msg(format!("dist: no free port: {e}")))
}
