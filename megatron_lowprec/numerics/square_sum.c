/* Exact sums of squares of float32 and bfloat16 values on the CPU, in one pass over the data
 * (square_sum.py compiles this file at first use, and computes the same sums with torch operations
 * on other devices).
 *
 * A finite float32 x is s * 2^(e - 150) (s < 2^24, e its biased exponent, 1 for subnormals), so
 * u = x^2 * 2^298 = s^2 * 2^(2e - 2) is an integer below 2^556, exact in float64, whose bits lie in
 * [2e - 2, 2e + 46). The result is the sums of the G-bit digits of u (G = DIGIT_BITS) over all the
 * values, digit d weighing 2^(G d), carried so that every sum but the last is below 2^G: one form
 * for one value, whatever the order of the values.
 *
 * A block of BLOCK values finds the bits its values can occupy, [base, base + span), from its
 * largest and smallest nonzero magnitudes, and splits each t = u / 2^base (an integer below
 * 2^span) into G-bit local digits, exactly in float64. Most blocks of gradients span at most 2G
 * bits: their y = t / 2^G is split in one loop into its nearest integer (the bits of y + 2^52) and
 * the rest, in [-1/2, 1/2] with G fractional bits (the bits of the rest + 1.5 * 2^12). Wider blocks
 * take floor(t / 2^G) digit by digit. Every per-value quantity is summed as the integer its bits
 * hold, so the sums are exact in any order (and vectorize); each block's local digit sums, below
 * 2^(G + 10), are then shifted to their place among the global digits in integers.
 *
 * Where the CPU multiplies 52-bit integers (AVX-512 IFMA), a block whose exponents span at most
 * 52 - W binades (W the significand's bits: 24 for float32, 8 for bfloat16) takes a shorter path:
 * a = |x| * 2^(150 - lowest - (24 - W)) is an integer below 2^52, written into the low 52 bits of
 * a + 2^52 by one fused multiply-add, and u = a^2 * 2^(2 lowest - 2 + 2 (24 - W)) whose 104-bit
 * product's low and high 52 bits the IFMA instructions add into two integer sums (below 2^62 per
 * block). Integer sums again: the same digits as the other paths, in any order. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512IFMA__)
#include <immintrin.h>
#define PRODUCT_PATH 1
#define PRODUCT_LANES 4 /* accumulators of each half of the product: IFMA's latency hidden */
#else
#define PRODUCT_PATH 0
#endif

#define DIGITS 15
#define DIGIT_BITS 40
#define DIGIT_SCALE 0x1p40 /* 2^DIGIT_BITS */
#define DIGIT_MASK (((int64_t)1 << DIGIT_BITS) - 1)
#define SCALE_EXPONENT 298
#define BLOCK 1024
#define CARRY_BLOCKS 1024
#define PREFETCH_BLOCKS 2
#define EXPONENT_BITS 0x7f800000u
#define INTEGER_OFFSET 0x1p52     /* v + 2^52 holds an integer 0 <= v < 2^52 in its low bits */
#define FRACTION_OFFSET 0x1.8p12 /* r + 1.5 * 2^12 holds r in [-1/2, 1/2] in units of 2^-40 */

static void carry(int64_t *sums) {
    for (int digit = 0; digit < DIGITS - 1; digit++) {
        sums[digit + 1] += sums[digit] >> DIGIT_BITS;
        sums[digit] &= DIGIT_MASK;
    }
}

/* Adds total * 2^position (0 <= total < 2^(DIGIT_BITS + 10)) to the global digit sums. */
static void add_at(int64_t total, int position, int64_t *sums) {
    int digit = position / DIGIT_BITS, shift = position % DIGIT_BITS;
    int64_t rest = total >> (DIGIT_BITS - shift);
    int64_t parts[3] = {(total & (DIGIT_MASK >> shift)) << shift, rest & DIGIT_MASK, rest >> DIGIT_BITS};
    for (int part = 0; part < 3; part++)
        if (parts[part]) sums[digit + part] += parts[part];
}

/* 2^exponent for -1022 <= exponent <= 1023, without a call into the math library. */
static inline double power_of_two(int exponent) {
    uint64_t bits = (uint64_t)(exponent + 1023) << 52;
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint64_t bits_of(double value) {
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The sum of BLOCK values from the sum of the bits of each value + offset (modulo 2^64). */
static int64_t block_total(uint64_t bits_sum, double offset) {
    return (int64_t)(bits_sum - (uint64_t)BLOCK * bits_of(offset));
}

/* x^2 * scale, exact (scale is a power of 2); 0 for a non-finite x where checked. */
static inline double scaled_square(uint32_t bits, double scale, int checked) {
    float value;
    memcpy(&value, &bits, sizeof value);
    double x = value;
    double square = x * x * scale;
    if (checked) square = (bits & EXPONENT_BITS) != EXPONENT_BITS ? square : 0.0;
    return square;
}

/* The two local digits of a block that spans at most 2 DIGIT_BITS bits, from y = u / 2^(base + G). */
static inline void add_two_digits(const uint32_t *bits, double scale, int checked, int base, int64_t *sums) {
    uint64_t integers = 0, fractions = 0;
    for (int i = 0; i < BLOCK; i++) {
        double y = scaled_square(bits[i], scale, checked);
        double shifted = y + INTEGER_OFFSET;
        integers += bits_of(shifted);
        fractions += bits_of((y - (shifted - INTEGER_OFFSET)) + FRACTION_OFFSET);
    }
    int64_t low = block_total(fractions, FRACTION_OFFSET), high = block_total(integers, INTEGER_OFFSET);
    int64_t borrow = low >> DIGIT_BITS;
    add_at(low - borrow * ((int64_t)1 << DIGIT_BITS), base, sums);
    add_at(high + borrow, base + DIGIT_BITS, sums);
}

#if PRODUCT_PATH
/* Adds total * 2^position (0 <= total < 2^63) to the global digit sums. */
static void add_wide_at(uint64_t total, int position, int64_t *sums) {
    int digit = position / DIGIT_BITS;
    unsigned __int128 shifted = (unsigned __int128)total << (position % DIGIT_BITS);
    for (int part = 0; part < 3 && shifted; part++, shifted >>= DIGIT_BITS)
        sums[digit + part] += (int64_t)(shifted & DIGIT_MASK);
}

/* The IFMA path (see the top of this file) for a block whose values' exponents lie in [lowest,
 * lowest + 52 - significand_bits], which the same pass checks (their largest and smallest nonzero
 * magnitudes): returns 1 where they do, with the block's sums added, and 0, adding nothing, where a
 * value lies outside or is not finite. */
static int add_products(const uint32_t *bits, int lowest, int significand_bits, int64_t *sums) {
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7fffffff), ones = _mm512_set1_epi32(1);
    const __m512d scale = _mm512_set1_pd(power_of_two(150 - lowest - (24 - significand_bits)));
    const __m512d offset = _mm512_set1_pd(INTEGER_OFFSET);
    __m512i top = _mm512_setzero_si512(), bottom = _mm512_set1_epi32(-1);
    __m512i low[PRODUCT_LANES], high[PRODUCT_LANES];
    for (int lane = 0; lane < PRODUCT_LANES; lane++) low[lane] = high[lane] = _mm512_setzero_si512();
    for (int i = 0; i < BLOCK; i += 8 * PRODUCT_LANES) {
        for (int pair = 0; pair < PRODUCT_LANES; pair += 2) {
            __m512i magnitudes = _mm512_and_si512(_mm512_loadu_si512(bits + i + 8 * pair), magnitude_mask);
            top = _mm512_max_epu32(top, magnitudes);
            bottom = _mm512_min_epu32(bottom, _mm512_sub_epi32(magnitudes, ones));
            __m512 values = _mm512_castsi512_ps(magnitudes);
            __m512d halves[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(values)),
                                 _mm512_cvtps_pd(_mm512_extractf32x8_ps(values, 1))};
            for (int half = 0; half < 2; half++) {
                __m512i integer = _mm512_castpd_si512(_mm512_fmadd_pd(halves[half], scale, offset));
                low[pair + half] = _mm512_madd52lo_epu64(low[pair + half], integer, integer);
                high[pair + half] = _mm512_madd52hi_epu64(high[pair + half], integer, integer);
            }
        }
    }
    uint32_t largest = _mm512_reduce_max_epu32(top), smallest = _mm512_reduce_min_epu32(bottom) + 1;
    int highest = largest >> 23 > 1 ? (int)(largest >> 23) : 1;
    int below = smallest != 0 && (smallest >> 23 > 1 ? (int)(smallest >> 23) : 1) < lowest;
    if (largest >= EXPONENT_BITS || highest > lowest + 52 - significand_bits || below) return 0;
    for (int lane = 1; lane < PRODUCT_LANES; lane++) {
        low[0] = _mm512_add_epi64(low[0], low[lane]);
        high[0] = _mm512_add_epi64(high[0], high[lane]);
    }
    int base = 2 * lowest - 2 + 2 * (24 - significand_bits);
    add_wide_at((uint64_t)_mm512_reduce_add_epi64(low[0]), base, sums);
    add_wide_at((uint64_t)_mm512_reduce_add_epi64(high[0]), base + 52, sums);
    return 1;
}
#endif

/* Adds the digit sums of BLOCK float32 bit patterns to sums[0..DIGITS-1], their count of non-finite
 * values to sums[DIGITS] and of NaNs to sums[DIGITS + 1]. Returns the exponent of the largest value
 * where the IFMA path summed the block, else 0. */
static int add_block(const uint32_t *bits, int significand_bits, int64_t *sums) {
    /* The largest magnitude, and the smallest nonzero one less 1 (zeros wrap above every other). */
    uint32_t top = 0, bottom = 0xffffffffu;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t magnitude = bits[i] & 0x7fffffffu;
        top = magnitude > top ? magnitude : top;
        bottom = magnitude - 1 < bottom ? magnitude - 1 : bottom;
    }
    int non_finite = top >= EXPONENT_BITS;
    if (non_finite) {
        top = 0;
        bottom = 0xffffffffu;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t magnitude = bits[i] & 0x7fffffffu;
            sums[DIGITS] += magnitude >= EXPONENT_BITS;
            sums[DIGITS + 1] += magnitude > EXPONENT_BITS;
            if (magnitude >= EXPONENT_BITS) continue;
            top = magnitude > top ? magnitude : top;
            bottom = magnitude - 1 < bottom ? magnitude - 1 : bottom;
        }
    }
    if (top == 0) return 0;
    int highest = top >> 23 > 1 ? (int)(top >> 23) : 1;
    int lowest = (bottom + 1) >> 23 > 1 ? (int)((bottom + 1) >> 23) : 1;
#if PRODUCT_PATH
    if (!non_finite && highest - lowest <= 52 - significand_bits && add_products(bits, lowest, significand_bits, sums))
        return highest;
#else
    (void)significand_bits;
#endif
    int base = 2 * lowest - 2;
    int local_digits = (2 * (highest - lowest) + 48 + DIGIT_BITS - 1) / DIGIT_BITS;
    double scale = power_of_two(SCALE_EXPONENT - base);
    if (local_digits <= 2) {
        if (non_finite)
            add_two_digits(bits, scale / DIGIT_SCALE, 1, base, sums);
        else
            add_two_digits(bits, scale / DIGIT_SCALE, 0, base, sums);
        return 0;
    }
    double rests[BLOCK];
    for (int i = 0; i < BLOCK; i++) rests[i] = scaled_square(bits[i], scale, 1);
    for (int local = 0; local < local_digits; local++) {
        uint64_t digits = 0;
        for (int i = 0; i < BLOCK; i++) {
            double upper = floor(rests[i] / DIGIT_SCALE);
            digits += bits_of(rests[i] - upper * DIGIT_SCALE + INTEGER_OFFSET);
            rests[i] = upper;
        }
        add_at(block_total(digits, INTEGER_OFFSET), base + DIGIT_BITS * local, sums);
    }
    return 0;
}

/* Adds the digit sums and counts of count values to sums: float32 bit patterns (width 4) or
 * bfloat16 ones (width 2, widened by shifting them up 16 bits). */
static void add_values(const void *values, int width, int64_t count, int64_t *sums) {
    uint32_t block[BLOCK];
    int64_t blocks = 0;
    /* The IFMA path's lowest exponent for the next block, from the last block that took it (its
     * largest exponent one binade below the top of the window), or 0: gradients' blocks mostly
     * share their range, and the pass checks it (add_products). */
#if PRODUCT_PATH
    int lowest_guess = 0;
#endif
    for (int64_t start = 0; start < count; start += BLOCK) {
        int64_t length = count - start < BLOCK ? count - start : BLOCK;
        const uint32_t *bits = block;
        if (width == 2) {
            const uint16_t *narrow = (const uint16_t *)values + start;
            for (int64_t i = 0; i < length; i++) block[i] = (uint32_t)narrow[i] << 16;
        } else if (length == BLOCK) {
            bits = (const uint32_t *)values + start;
        } else {
            memcpy(block, (const uint32_t *)values + start, length * sizeof *block);
        }
        if (length < BLOCK) memset(block + length, 0, (BLOCK - length) * sizeof *block);
        if (start + (PREFETCH_BLOCKS + 1) * BLOCK <= count)
            for (int byte = 0; byte < BLOCK * width; byte += 64)
                __builtin_prefetch((const char *)values + (start + PREFETCH_BLOCKS * BLOCK) * width + byte);
        int significand_bits = width == 2 ? 8 : 24;
#if PRODUCT_PATH
        if (lowest_guess && add_products(bits, lowest_guess, significand_bits, sums)) {
            if (++blocks % CARRY_BLOCKS == 0) carry(sums);
            continue;
        }
        int highest = add_block(bits, significand_bits, sums);
        int window_bottom = highest + 1 - (52 - significand_bits);
        lowest_guess = highest == 0 ? 0 : window_bottom > 1 ? window_bottom : 1;
#else
        add_block(bits, significand_bits, sums);
#endif
        if (++blocks % CARRY_BLOCKS == 0) carry(sums);
    }
    carry(sums);
}

void square_sum_float32(const uint32_t *bits, int64_t count, int64_t *sums) { add_values(bits, 4, count, sums); }

void square_sum_bfloat16(const uint16_t *bits, int64_t count, int64_t *sums) { add_values(bits, 2, count, sums); }
