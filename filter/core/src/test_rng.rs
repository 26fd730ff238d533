//! The one deterministic PRNG of the host tests (no crates here): xorshift64*.

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// An index below `n` (n > 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }
}
