//! An inclusive range of whole numbers given on the command line as `N` or `MIN-MAX`, drawn
//! from uniformly.

use std::fmt;
use std::str::FromStr;

use rand::Rng;

/// `min..=max`; `N` means exactly `N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRange {
    pub min: u32,
    pub max: u32,
}

impl TokenRange {
    pub const fn new(min: u32, max: u32) -> Self {
        Self { min, max }
    }

    /// A uniform draw from the range.
    pub fn draw(&self, rng: &mut impl Rng) -> u32 {
        rng.random_range(self.min..=self.max)
    }
}

impl FromStr for TokenRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let number = |part: &str| {
            part.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?} is not N or MIN-MAX (whole numbers, MIN ≤ MAX)"))
        };
        let (min, max) = match s.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(s)?;
                (n, n)
            }
        };
        if min > max {
            return Err(format!("{s:?}: MIN is above MAX"));
        }
        Ok(Self { min, max })
    }
}

impl fmt::Display for TokenRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn parses_one_number_or_a_range() {
        assert_eq!("6".parse::<TokenRange>(), Ok(TokenRange::new(6, 6)));
        assert_eq!("4-8".parse::<TokenRange>(), Ok(TokenRange::new(4, 8)));
        assert_eq!("4 - 8".parse::<TokenRange>(), Ok(TokenRange::new(4, 8)));
        assert!(
            "8-4"
                .parse::<TokenRange>()
                .unwrap_err()
                .contains("MIN is above MAX")
        );
        assert!("-4".parse::<TokenRange>().is_err());
        assert!("4-".parse::<TokenRange>().is_err());
        assert!("x".parse::<TokenRange>().is_err());
        assert_eq!(TokenRange::new(4, 8).to_string(), "4-8");
        assert_eq!(TokenRange::new(3, 3).to_string(), "3");
    }

    #[test]
    fn draws_stay_inside() {
        let mut rng = StdRng::seed_from_u64(1);
        let r = TokenRange::new(4, 8);
        let draws: Vec<u32> = (0..200).map(|_| r.draw(&mut rng)).collect();
        assert!(draws.iter().all(|d| (4..=8).contains(d)));
        assert!(draws.contains(&4) && draws.contains(&8));
    }
}
