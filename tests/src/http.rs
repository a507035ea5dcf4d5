//! A minimal HTTP/1.0 GET for readiness probes and metrics, so the harness needs no HTTP stack.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `GET http://127.0.0.1:<port><path>`: the status code and body, or `None` if unreachable.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// The value of sample `name` (exactly, labels included, as rendered, e.g.
/// `kvroute_router_errors_total{code="bad_request"}`) at the process's `/metrics` on `port`.
///
/// Panics when the process does not answer, or when the exposition does not declare the
/// sample's metric family (a `# TYPE` line), or when an unlabelled sample is absent: a
/// misspelt name, a missing label or a dead process must fail the test, not read as 0. A
/// labelled sample of a declared family is 0 until it is rendered (a labelled counter that has
/// not counted yet). For a process that may be briefly unreachable (paused, restarting),
/// use [`metric_sample_if_up`].
pub fn metric_sample(port: u16, name: &str) -> f64 {
    match metric_sample_if_up(port, name) {
        Some(value) => value,
        None => panic!("metric {name}: nothing answered GET /metrics on 127.0.0.1:{port}"),
    }
}

/// [`metric_sample`], but `None` when the process does not answer.
pub fn metric_sample_if_up(port: u16, name: &str) -> Option<f64> {
    let (status, body) = http_get(port, "/metrics")?;
    assert_eq!(status, 200, "GET /metrics on 127.0.0.1:{port}: {body}");
    match sample_value(&body, name) {
        Ok(value) => Some(value),
        Err(e) => panic!("metric {name} on 127.0.0.1:{port}: {e}"),
    }
}

/// Why [`sample_value`] found no value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    #[error("no metric family {0:?} is declared (no `# TYPE` line)")]
    Undeclared(String),
    #[error("no sample {0:?} (a labelled family's samples must name their labels)")]
    Absent(String),
    #[error("the sample's value {0:?} is not a number")]
    NotANumber(String),
}

/// The value of sample `name` in a Prometheus text exposition: see [`metric_sample`].
pub fn sample_value(exposition: &str, name: &str) -> Result<f64, SampleError> {
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        if let Some((sample, value)) = line.rsplit_once(' ')
            && sample == name
        {
            return value
                .parse()
                .map_err(|_| SampleError::NotANumber(value.to_owned()));
        }
    }
    let Some((family, _labels)) = name.split_once('{') else {
        // An unlabelled metric always renders its sample: absent, the name is wrong (or the
        // family has labels, and the sample must name them).
        return Err(SampleError::Absent(name.to_owned()));
    };
    // A sample's family: its name, or its name without a suffix the exposition adds
    // (counters' `_total`, histograms' `_bucket` / `_sum` / `_count`).
    let candidates = std::iter::once(family).chain(
        ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| family.strip_suffix(suffix)),
    );
    let declared = |f: &str| {
        exposition.lines().any(|l| {
            l.strip_prefix("# TYPE ")
                .and_then(|rest| rest.split(' ').next())
                == Some(f)
        })
    };
    for f in candidates {
        if declared(f) {
            return Ok(0.0);
        }
    }
    Err(SampleError::Undeclared(family.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPOSITION: &str = "# HELP a_total Things.\n# TYPE a_total counter\na_total 3\n\
        # HELP b_total Labelled.\n# TYPE b_total counter\nb_total{code=\"x\"} 2\n\
        # HELP c Counter declared without the suffix.\n# TYPE c counter\n\
        # HELP g A gauge.\n# TYPE g gauge\ng 1.5\ngg 9\n";

    #[test]
    fn samples_are_matched_exactly_labels_included() {
        assert_eq!(sample_value(EXPOSITION, "a_total"), Ok(3.0));
        assert_eq!(sample_value(EXPOSITION, "b_total{code=\"x\"}"), Ok(2.0));
        assert_eq!(sample_value(EXPOSITION, "g"), Ok(1.5));
    }

    #[test]
    fn a_declared_family_without_the_sample_is_zero() {
        assert_eq!(sample_value(EXPOSITION, "b_total{code=\"y\"}"), Ok(0.0));
        assert_eq!(sample_value(EXPOSITION, "c_total{code=\"y\"}"), Ok(0.0));
    }

    #[test]
    fn an_undeclared_family_is_an_error_not_zero() {
        assert_eq!(
            sample_value(EXPOSITION, "a_totall{code=\"x\"}"),
            Err(SampleError::Undeclared("a_totall".into()))
        );
        assert_eq!(
            sample_value(EXPOSITION, "missing{code=\"x\"}"),
            Err(SampleError::Undeclared("missing".into()))
        );
        // `gg` is a sample, not a declared family: a prefix never counts.
        assert!(sample_value(EXPOSITION, "g_other{a=\"b\"}").is_err());
    }

    #[test]
    fn an_absent_unlabelled_sample_is_an_error_not_zero() {
        // A labelled family asked for without labels, a misspelt or missing unlabelled name.
        for name in ["b_total", "c", "a_totall", "gg_x"] {
            assert_eq!(
                sample_value(EXPOSITION, name),
                Err(SampleError::Absent(name.into()))
            );
        }
    }

    #[test]
    #[should_panic(expected = "nothing answered GET /metrics")]
    fn an_absent_process_fails_the_test() {
        metric_sample(crate::ports::free_port(), "a_total");
    }
}
