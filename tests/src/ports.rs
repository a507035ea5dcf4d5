//! Free loopback ports (never the services' default ports).

use std::net::TcpListener;

const RESERVED: [u16; 4] = [4222, 2379, 2380, 8222];

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("binding an ephemeral port on 127.0.0.1");
        if !RESERVED.contains(&port) {
            return port;
        }
    }
}
