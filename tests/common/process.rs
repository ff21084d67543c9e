//! Process backend: `redis-server` children on 127.0.0.1.
//!
//! Each node writes its log to `$TMPDIR/quorumlock-harness/<pid>-<port>.log` and its pid
//! (with the owner's `owner_tag`) to `...-<port>.pid`; a later test process kills the
//! redis-servers of an owner that died without running Drop (SIGKILL of the test binary).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{owner_alive, owner_tag, run_cmd, wait_for_ping};

const START_LIMIT: Duration = Duration::from_secs(15);

pub(crate) struct ProcessEnv {
    bin: PathBuf,
    dir: PathBuf,
}

pub(crate) fn probe() -> Result<ProcessEnv, String> {
    let candidates: Vec<PathBuf> = match std::env::var_os("QUORUMLOCK_REDIS_SERVER") {
        Some(p) if !p.is_empty() => vec![PathBuf::from(p)],
        _ => vec![
            PathBuf::from("redis-server"),
            PathBuf::from("/usr/bin/redis-server"),
            PathBuf::from("/usr/local/bin/redis-server"),
            PathBuf::from("/opt/homebrew/bin/redis-server"),
        ],
    };
    let mut errors = Vec::new();
    for bin in candidates {
        match run_cmd(Command::new(&bin).arg("--version"), Duration::from_secs(10)) {
            Ok(v) if v.contains("Redis server") => {
                let dir = std::env::temp_dir().join("quorumlock-harness");
                fs::create_dir_all(&dir)
                    .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                sweep_orphans(&dir);
                return Ok(ProcessEnv { bin, dir });
            }
            Ok(v) => errors.push(format!(
                "{}: unexpected --version output {v:?}",
                bin.display()
            )),
            Err(e) => errors.push(e),
        }
    }
    Err(format!("no working redis-server: {}", errors.join("; ")))
}

/// Kills redis-servers whose owning test process (same host) is gone. A pid file holds
/// `"<redis pid> <owner tag>"`.
fn sweep_orphans(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let host = super::hostname();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(stem) = name.strip_suffix(".pid") else {
            continue;
        };
        let Ok(content) = fs::read_to_string(e.path()) else {
            continue;
        };
        let Some((pid, owner)) = content.trim().split_once(' ') else {
            continue;
        };
        if owner.split('/').next() != Some(host.as_str()) || owner_alive(owner) {
            continue;
        }
        let port = stem.rsplit('-').next().unwrap_or("");
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("redis-server") && !port.is_empty() && cmdline.contains(port) {
            let _ = signal(pid, "KILL");
        }
        let _ = fs::remove_file(e.path());
        let _ = fs::remove_file(dir.join(format!("{stem}.log")));
        let _ = fs::remove_dir_all(dir.join(format!("{stem}.d")));
    }
}

pub(crate) struct ProcessNode {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    paused: bool,
    log: PathBuf,
    pidfile: PathBuf,
    workdir: PathBuf,
    /// Extra environment for redis-server (e.g. libfaketime's).
    extra_env: Vec<(String, String)>,
}

impl ProcessNode {
    pub(crate) fn start(env: &ProcessEnv, port: u16) -> Result<ProcessNode, String> {
        Self::start_with_env(env, port, Vec::new())
    }

    pub(crate) fn start_with_env(
        env: &ProcessEnv,
        port: u16,
        extra_env: Vec<(String, String)>,
    ) -> Result<ProcessNode, String> {
        let stem = format!("{}-{port}", std::process::id());
        let workdir = env.dir.join(format!("{stem}.d"));
        fs::create_dir_all(&workdir)
            .map_err(|e| format!("cannot create {}: {e}", workdir.display()))?;
        let mut node = ProcessNode {
            bin: env.bin.clone(),
            port,
            child: None,
            paused: false,
            log: env.dir.join(format!("{stem}.log")),
            pidfile: env.dir.join(format!("{stem}.pid")),
            workdir,
            extra_env,
        };
        match node.spawn() {
            Ok(()) => Ok(node),
            Err(e) => {
                node.cleanup_files();
                Err(e)
            }
        }
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = fs::File::create(&self.log)
            .map_err(|e| format!("cannot create {}: {e}", self.log.display()))?;
        let log2 = log
            .try_clone()
            .map_err(|e| format!("cannot dup log file: {e}"))?;
        let port = self.port.to_string();
        let child = Command::new(&self.bin)
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(super::THROWAWAY)
            .args(["--daemonize", "no", "--logfile", ""])
            .arg("--dir")
            .arg(&self.workdir)
            .current_dir(&self.workdir)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.bin.display()))?;
        let _ = fs::write(&self.pidfile, format!("{} {}", child.id(), owner_tag()));
        self.child = Some(child);
        self.paused = false;
        let log = self.log.clone();
        let child = self.child.as_mut().expect("just spawned");
        let r = wait_for_ping("127.0.0.1", self.port, START_LIMIT, || {
            match child.try_wait() {
                Ok(Some(status)) => Err(format!(
                    "redis-server on port {port} exited ({status}); log:\n{}",
                    tail(&log)
                )),
                _ => Ok(()),
            }
        });
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                self.kill();
                Err(format!(
                    "{e}\nlog {}:\n{}",
                    self.log.display(),
                    tail(&self.log)
                ))
            }
        }
    }

    fn pid(&self) -> Result<String, String> {
        self.child
            .as_ref()
            .map(|c| c.id().to_string())
            .ok_or_else(|| format!("node on port {} is stopped", self.port))
    }

    /// SIGKILL + wait (no zombie). Works on a SIGSTOPped process too.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.paused = false;
    }

    pub(crate) fn stop(&mut self) -> Result<(), String> {
        self.kill();
        Ok(())
    }

    pub(crate) fn restart(&mut self) -> Result<(), String> {
        self.kill();
        // The port was ours a moment ago; if something grabbed it meanwhile, give it a
        // little time before failing.
        let mut last = String::new();
        for _ in 0..5 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(last)
    }

    pub(crate) fn pause(&mut self) -> Result<(), String> {
        let pid = self.pid()?;
        signal(&pid, "STOP")?;
        self.paused = true;
        Ok(())
    }

    pub(crate) fn unpause(&mut self) -> Result<(), String> {
        let pid = self.pid()?;
        signal(&pid, "CONT")?;
        self.paused = false;
        Ok(())
    }

    /// Final teardown (Drop of the cluster).
    pub(crate) fn remove(mut self) {
        self.kill();
        self.cleanup_files();
    }

    fn cleanup_files(&self) {
        let _ = fs::remove_file(&self.pidfile);
        let _ = fs::remove_file(&self.log);
        let _ = fs::remove_dir_all(&self.workdir);
    }
}

impl Drop for ProcessNode {
    fn drop(&mut self) {
        // Backstop for paths that do not go through `remove` (e.g. a failed start).
        self.kill();
    }
}

/// `kill -s SIG pid` through /bin/sh's builtin (no libc crate, no procps needed).
fn signal(pid: &str, sig: &str) -> Result<(), String> {
    run_cmd(
        Command::new("/bin/sh").args(["-c", "kill -s \"$0\" \"$1\"", sig, pid]),
        Duration::from_secs(5),
    )
    .map(|_| ())
}

fn tail(path: &Path) -> String {
    let s = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}
