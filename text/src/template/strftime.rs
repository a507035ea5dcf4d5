//! `strftime_now(format)`: transformers' `datetime.now().strftime(format)`, for UTC (the time
//! zone of the hosts kvroute runs on; a local time zone is not applied). The formatting is pure:
//! `strftime(format, unix_seconds)`.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `format` applied to the current time.
pub(crate) fn strftime_now(format: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| (d.as_secs() as i64, d.subsec_micros()))
        .unwrap_or((0, 0));
    strftime(format, now.0, now.1)
}

/// The civil date of a day count since 1970-01-01 (proleptic Gregorian): (year, month 1..12, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// glibc's strftime for the common conversions (`%a %A %b %B %h %d %e %m %y %Y %H %I %M %S %p
/// %j %f %u %w %F %T %D %R %c %x %X %%`, `%-d` without padding); others are kept as written.
pub(crate) fn strftime(format: &str, unix_seconds: i64, micros: u32) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(month > 2 && is_leap(year));
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('d') => num(&mut out, i64::from(day), 2),
            Some('e') => {
                let _ = write!(out, "{day:2}");
            }
            Some('m') => num(&mut out, i64::from(month), 2),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => num(&mut out, i64::from(yday), 3),
            Some('f') => {
                let _ = write!(out, "{micros:06}");
            }
            Some('u') => {
                let _ = write!(out, "{}", if weekday == 0 { 7 } else { weekday });
            }
            Some('w') => {
                let _ = write!(out, "{weekday}");
            }
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('R') => {
                let _ = write!(out, "{hour:02}:{minute:02}");
            }
            Some('D') | Some('x') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('X') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('c') => {
                let _ = write!(
                    out,
                    "{} {} {day:2} {hour:02}:{minute:02}:{second:02} {year}",
                    &DAYS[weekday][..3],
                    &MONTHS[month as usize - 1][..3]
                );
            }
            Some('Z') | Some('z') => {} // a naive datetime has no zone
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::strftime;

    #[test]
    fn formats_like_python() {
        // datetime(2024, 7, 26, 9, 5, 3).strftime(...) — a Friday; 1721984703 is that time in UTC.
        let t = 1_721_984_703;
        assert_eq!(strftime("%d %b %Y", t, 0), "26 Jul 2024");
        assert_eq!(
            strftime("%A, %B %-d, %y %H:%M:%S %p %I", t, 0),
            "Friday, July 26, 24 09:05:03 AM 09"
        );
        assert_eq!(
            strftime("%j %u %w %F %T %% %Q", t, 42),
            "208 5 5 2024-07-26 09:05:03 % %Q"
        );
        assert_eq!(strftime("%Y-%m-%d", 951_782_400, 0), "2000-02-29");
        assert_eq!(strftime("%a %Y-%m-%d %j", 0, 0), "Thu 1970-01-01 001");
        assert_eq!(strftime("%f", 0, 7), "000007");
    }
}
