//! A minimal HTTP/1.0 GET for readiness probes and metrics, so the harness needs no HTTP stack.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvroute_common::ops::OneOf;

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
/// sample's metric family (a `# TYPE` line), or when an unlabelled sample is absent, or when
/// an absent labelled sample names a label or a label value that the code never counts under
/// that family ([`ONE_OF`]): a misspelt name or label, a missing label or a dead process must
/// fail the test, not read as 0. Any other labelled sample of a declared family is 0 until
/// it is rendered (a counter per worker or model that has not counted yet). For a process that
/// may be briefly unreachable (paused, restarting), use [`metric_sample_if_up`].
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
    match sample_value(&body, name, &one_of()) {
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
    #[error("family {family} has no label {label:?} (its label is {expected:?})")]
    UnknownLabel {
        family: String,
        label: String,
        expected: &'static str,
    },
    #[error("the code never counts {family} with {label}={value:?} (its values: {values:?})")]
    UnknownValue {
        family: String,
        label: String,
        value: String,
        values: Vec<&'static str>,
    },
}

/// Every family whose label values the code lists: the router's and the indexer's (each
/// includes the discovery's bad cards).
pub fn one_of() -> Vec<OneOf> {
    let mut all: Vec<OneOf> = kvroute_router::service::metrics::labels::ALL.to_vec();
    all.extend(kvroute_indexer::service::metrics::labels::ALL);
    all
}

/// The sample name of `family` with these labels, as rendered:
/// `series("x_total", &[("code", "bad_request")])` is `x_total{code="bad_request"}`.
pub fn series(family: &str, labels: &[(&str, &str)]) -> String {
    let labels: Vec<String> = labels
        .iter()
        .map(|(name, value)| format!("{name}=\"{value}\""))
        .collect();
    format!("{family}{{{}}}", labels.join(","))
}

/// The sample of a listed family with this value: `labelled(labels::ERRORS, "too_large")`.
pub fn labelled(spec: OneOf, value: &str) -> String {
    series(spec.family, &[(spec.label, value)])
}

/// The `name="value"` pairs of a sample's labels (values unescaped only as far as the tests
/// need: no `",` inside a value).
fn label_pairs(labels: &str) -> Vec<(&str, &str)> {
    let labels = labels.strip_suffix('}').unwrap_or(labels);
    labels
        .split("\",")
        .filter_map(|pair| {
            let (name, value) = pair.split_once("=\"")?;
            Some((name, value.strip_suffix('"').unwrap_or(value)))
        })
        .collect()
}

/// The value of sample `name` in a Prometheus text exposition, given the families whose label
/// values the code lists: see [`metric_sample`].
pub fn sample_value(exposition: &str, name: &str, one_of: &[OneOf]) -> Result<f64, SampleError> {
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        if let Some((sample, value)) = line.rsplit_once(' ')
            && sample == name
        {
            return value
                .parse()
                .map_err(|_| SampleError::NotANumber(value.to_owned()));
        }
    }
    let Some((family, labels)) = name.split_once('{') else {
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
    if !candidates.into_iter().any(declared) {
        return Err(SampleError::Undeclared(family.to_owned()));
    }
    // A listed family renders every value it counts: an absent sample of one names a label or a
    // value the code never counts (a histogram's `le` is the exposition's own).
    for spec in one_of.iter().filter(|s| s.family == family) {
        for (label, value) in label_pairs(labels) {
            if label != spec.label {
                return Err(SampleError::UnknownLabel {
                    family: family.to_owned(),
                    label: label.to_owned(),
                    expected: spec.label,
                });
            }
            if !spec.allows(value) {
                return Err(SampleError::UnknownValue {
                    family: family.to_owned(),
                    label: label.to_owned(),
                    value: value.to_owned(),
                    values: (spec.values)(),
                });
            }
        }
    }
    Ok(0.0)
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
        assert_eq!(sample_value(EXPOSITION, "a_total", &[]), Ok(3.0));
        assert_eq!(
            sample_value(EXPOSITION, "b_total{code=\"x\"}", &[]),
            Ok(2.0)
        );
        assert_eq!(sample_value(EXPOSITION, "g", &[]), Ok(1.5));
    }

    #[test]
    fn a_declared_family_without_the_sample_is_zero() {
        assert_eq!(
            sample_value(EXPOSITION, "b_total{code=\"y\"}", &[]),
            Ok(0.0)
        );
        assert_eq!(
            sample_value(EXPOSITION, "c_total{code=\"y\"}", &[]),
            Ok(0.0)
        );
    }

    #[test]
    fn an_undeclared_family_is_an_error_not_zero() {
        assert_eq!(
            sample_value(EXPOSITION, "a_totall{code=\"x\"}", &[]),
            Err(SampleError::Undeclared("a_totall".into()))
        );
        assert_eq!(
            sample_value(EXPOSITION, "missing{code=\"x\"}", &[]),
            Err(SampleError::Undeclared("missing".into()))
        );
        // `gg` is a sample, not a declared family: a prefix never counts.
        assert!(sample_value(EXPOSITION, "g_other{a=\"b\"}", &[]).is_err());
    }

    #[test]
    fn an_absent_unlabelled_sample_is_an_error_not_zero() {
        // A labelled family asked for without labels, a misspelt or missing unlabelled name.
        for name in ["b_total", "c", "a_totall", "gg_x"] {
            assert_eq!(
                sample_value(EXPOSITION, name, &[]),
                Err(SampleError::Absent(name.into()))
            );
        }
    }

    #[test]
    fn a_misspelt_label_value_or_name_of_a_listed_family_is_an_error_not_zero() {
        use kvroute_common::messages::ErrorCode;
        use kvroute_router::service::metrics::{RouterMetrics, labels, names};
        let metrics = RouterMetrics::new();
        metrics.errors.inc(ErrorCode::TooLarge.as_str());
        let text = metrics.registry.render();
        let read = |name: &str| sample_value(&text, name, &one_of());
        let misspelt = series(names::ERRORS, &[("code", "bad_requets")]);
        // Before the families listed their values, this read 0 and an assertion of "no
        // bad_request errors" passed whatever the router did.
        assert_eq!(sample_value(&text, &misspelt, &[]), Ok(0.0));
        assert!(
            matches!(read(&misspelt), Err(SampleError::UnknownValue { ref value, .. }) if value == "bad_requets"),
            "{:?}",
            read(&misspelt)
        );
        assert!(matches!(
            read(&series(
                names::ERRORS,
                &[("cod", ErrorCode::BadRequest.as_str())]
            )),
            Err(SampleError::UnknownLabel { .. })
        ));
        // The values the code counts read as they are, 0 before the first.
        let code = |c: ErrorCode| series(names::ERRORS, &[(labels::ERRORS.label, c.as_str())]);
        assert_eq!(read(&code(ErrorCode::TooLarge)), Ok(1.0));
        assert_eq!(read(&code(ErrorCode::BadRequest)), Ok(0.0));
        // A family whose values come from outside (workers) still reads 0 before counting.
        assert_eq!(
            read(&series(names::DECISIONS, &[("worker", "9/0")])),
            Ok(0.0)
        );
    }

    #[test]
    #[should_panic(expected = "nothing answered GET /metrics")]
    fn an_absent_process_fails_the_test() {
        metric_sample(crate::ports::free_port(), "a_total");
    }
}
