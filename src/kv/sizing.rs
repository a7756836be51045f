//! Capacity arithmetic: how many sequences fit a byte budget, paged or contiguous.

/// KV bytes per token across all layers (K and V).
pub fn kv_bytes_per_token(
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    elem_bytes: usize,
) -> usize {
    2 * layers * kv_heads * head_dim * elem_bytes
}

/// Sequences that fit `budget` bytes when each reserves `max_len` tokens contiguously.
pub fn contiguous_capacity(budget: usize, bytes_per_token: usize, max_len: usize) -> usize {
    budget / (bytes_per_token * max_len).max(1)
}

/// Sequences of `len` tokens that fit `budget` bytes in pages of `page_size` tokens
/// (each sequence rounds up to whole pages).
pub fn paged_capacity(
    budget: usize,
    bytes_per_token: usize,
    page_size: usize,
    len: usize,
) -> usize {
    let pages = budget / (bytes_per_token * page_size).max(1);
    let per_seq = len.div_ceil(page_size).max(1);
    pages / per_seq
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_capacity_example() {
        // Seed paper: 4 GB budget, d = 128, max_len 2048, actual 512 -> 4x.
        let bpt = kv_bytes_per_token(32, 8, 128, 2);
        let budget = 4usize << 30;
        let c = contiguous_capacity(budget, bpt, 2048);
        let p = paged_capacity(budget, bpt, 16, 512);
        assert_eq!(p, 4 * c);
    }
}
