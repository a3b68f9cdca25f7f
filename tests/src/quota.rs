//! The quota service's binary as a process: `floodgate-quota` on free
//! loopback ports with a limits file of the caller's, stopped and started
//! again on the same ports, and its `/metrics`.

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::http::Conn;
use crate::ports::{built_file, free_port, scratch_dir};
use crate::process::Process;

/// The quota service binary, as `cargo build` (and `cargo test --workspace`) leaves it.
pub fn quota_bin() -> PathBuf {
    built_file("FLOODGATE_QUOTA_BIN", "target/debug/floodgate-quota", "cargo build -p floodgate-quota")
}

/// How a `floodgate-quota` runs, beside its limits file.
#[derive(Clone, Debug)]
pub struct QuotaOptions {
    /// The binary.
    pub bin: PathBuf,
    /// A short name, for its files (`<name>-limits.yaml`, `<name>.log`).
    pub name: String,
    /// Where its files go.
    pub dir: PathBuf,
    /// `--store`: `memory` or a Redis URL.
    pub store: String,
    /// The HTTP API's port (`--listen`); `None`: a free one.
    pub port: Option<u16>,
    /// Whether it also serves Envoy's rate limit service API over gRPC
    /// (`--grpc-listen`, on a free port).
    pub grpc: bool,
    /// Further command-line arguments.
    pub args: Vec<String>,
    /// Environment variables set for it.
    pub env: Vec<(String, String)>,
}

impl QuotaOptions {
    /// The debug build with `--store store`, in a scratch directory of its own.
    pub fn new(store: &str) -> QuotaOptions {
        QuotaOptions {
            bin: quota_bin(),
            name: "quota".into(),
            dir: scratch_dir(),
            store: store.to_string(),
            port: None,
            grpc: false,
            args: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// A running `floodgate-quota` on loopback; killed on drop, and can be
/// stopped and started again on the same ports.
pub struct QuotaServer {
    process: Option<Process>,
    /// Its HTTP port.
    pub port: u16,
    /// Its gRPC port, if it serves the rate limit service API.
    pub grpc_port: Option<u16>,
    options: QuotaOptions,
    args: Vec<String>,
    log: PathBuf,
}

impl QuotaServer {
    /// Starts the service with the limits in `limits` (YAML) and `--store store`.
    pub fn start(limits: &str, store: &str) -> QuotaServer {
        Self::launch(limits, QuotaOptions::new(store))
    }

    /// Starts the service with these extra command-line arguments.
    pub fn start_with(limits: &str, store: &str, extra: &[&str]) -> QuotaServer {
        let mut options = QuotaOptions::new(store);
        options.args = extra.iter().map(|a| a.to_string()).collect();
        Self::launch(limits, options)
    }

    /// Starts the service on `port`.
    pub fn start_on(port: u16, limits: &str, store: &str) -> QuotaServer {
        let mut options = QuotaOptions::new(store);
        options.port = Some(port);
        Self::launch(limits, options)
    }

    /// Starts the service with the limits in `limits` (YAML) as `options`
    /// say, and waits until it answers.
    pub fn launch(limits: &str, options: QuotaOptions) -> QuotaServer {
        let file = options.dir.join(format!("{}-limits.yaml", options.name));
        fs::write(&file, limits).unwrap();
        let port = options.port.unwrap_or_else(free_port);
        let grpc_port = options.grpc.then(free_port);
        let mut args = vec![
            "--config".to_string(),
            file.display().to_string(),
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--store".to_string(),
            options.store.clone(),
        ];
        if let Some(grpc) = grpc_port {
            args.extend(["--grpc-listen".to_string(), format!("127.0.0.1:{grpc}")]);
        }
        args.extend(options.args.iter().cloned());
        let log = options.dir.join(format!("{}.log", options.name));
        let mut service = QuotaServer { process: None, port, grpc_port, options, args, log };
        service.restart();
        service
    }

    /// Starts it again (after [`QuotaServer::kill`]) and waits until it
    /// answers `/healthz` (and its gRPC port accepts connections).
    pub fn restart(&mut self) {
        assert!(self.process.is_none(), "already running");
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut command = Command::new(&self.options.bin);
        command.args(&self.args).envs(self.options.env.iter().cloned()).stdout(Stdio::null()).stderr(log);
        let process =
            Process::spawn(&mut command).unwrap_or_else(|e| panic!("cannot start {}: {e}", self.options.bin.display()));
        let process = self.process.insert(process);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = process.exited() {
                panic!("floodgate-quota exited with {status}:\n{}", fs::read_to_string(&self.log).unwrap_or_default());
            }
            let healthy = Conn::open(self.port)
                .is_ok_and(|mut conn| conn.try_request("GET", "/healthz", &[]).is_ok_and(|r| r.status == 200));
            let grpc = self.grpc_port.is_none_or(|port| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
            if healthy && grpc {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the quota service did not answer within 30 s:\n{}", fs::read_to_string(&self.log).unwrap_or_default());
    }

    /// Kills the process (SIGKILL): a crash, as the filter sees it.
    pub fn kill(&mut self) {
        self.process = None;
    }

    /// A counter of its `/metrics`, summed over the label sets whose labels
    /// contain every one of `labels`; 0 if absent or if the service does
    /// not answer.
    pub fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        let body = Conn::open(self.port)
            .ok()
            .and_then(|mut conn| conn.try_request("GET", "/metrics", &[]).ok())
            .map(|response| String::from_utf8_lossy(&response.body).into_owned())
            .unwrap_or_default();
        body.lines()
            .filter(|line| {
                line.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' ']))
                    && labels.iter().all(|l| line.contains(l))
            })
            .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }

    /// The calls it has answered on one endpoint (`lease`, `check`,
    /// `return`, `rls`), whatever their status:
    /// `floodgate_quota_requests_total` summed over its `status` label.
    pub fn requests(&self, endpoint: &str) -> u64 {
        self.metric("floodgate_quota_requests_total", &[&format!("endpoint=\"{endpoint}\"")]) as u64
    }
}
