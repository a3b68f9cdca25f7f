//! The raw HTTP/1.1 client: plain requests over keep-alive connections. It
//! is hand-rolled on purpose: tests must be able to send bytes a
//! well-behaved client library refuses to (non-UTF-8 header values,
//! thousands of headers).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 keep-alive connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    /// Connects to 127.0.0.1:`port`.
    pub fn open(port: u16) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        stream.set_nodelay(true)?;
        Ok(Conn { reader: BufReader::new(stream) })
    }

    /// Sends `GET path` with `headers` (raw bytes) and reads the response.
    pub fn get(&mut self, path: &str, headers: &[(&str, &[u8])]) -> HttpResponse {
        self.request("GET", path, headers)
    }

    /// Sends a bodiless request and reads the response.
    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &[u8])]) -> HttpResponse {
        self.try_request(method, path, headers).unwrap()
    }

    /// Sends a bodiless request without reading the answer (for a client
    /// that gives up).
    pub fn send_only(&mut self, method: &str, path: &str, headers: &[(&str, &[u8])]) -> std::io::Result<()> {
        let mut raw = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n").into_bytes();
        for (name, value) in headers {
            raw.extend_from_slice(name.as_bytes());
            raw.extend_from_slice(b": ");
            raw.extend_from_slice(value);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"\r\n");
        self.reader.get_mut().write_all(&raw)
    }

    /// Like [`Conn::request`], but returns I/O errors.
    pub fn try_request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &[u8])],
    ) -> std::io::Result<HttpResponse> {
        self.send_only(method, path, headers)?;
        self.read_response()
    }

    fn read_response(&mut self) -> std::io::Result<HttpResponse> {
        let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(&line))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            let (name, value) = trimmed.split_once(':').ok_or_else(|| bad(trimmed))?;
            headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
        }
        let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
        let body = if chunked {
            self.read_chunked()?
        } else {
            let length: usize =
                headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0; length];
            self.reader.read_exact(&mut body)?;
            body
        };
        Ok(HttpResponse { status, headers, body })
    }

    fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, line.clone()))?;
            let start = body.len();
            body.resize(start + size, 0);
            self.reader.read_exact(&mut body[start..])?;
            line.clear();
            self.reader.read_line(&mut line)?; // CRLF after the chunk (or after the trailers)
            if size == 0 {
                return Ok(body);
            }
        }
    }
}
