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
 * A block of BLOCK values finds the span of bits its values can occupy, [base, base + span), from
 * its largest and smallest nonzero magnitudes. Each t = u / 2^base is then an integer below
 * 2^span, split into G-bit local digits floor(t / 2^(G j)) - 2^G floor(t / 2^(G (j + 1))), exact in
 * float64; their float64 sums over the block stay below 2^(G + 10) < 2^53, exact. Most blocks of
 * gradients span at most 2G bits, two local digits, computed in one loop. Each local digit sum is
 * then shifted to its place among the global digits in integers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DIGITS 15
#define DIGIT_BITS 40
#define DIGIT_SCALE 0x1p40 /* 2^DIGIT_BITS */
#define DIGIT_MASK (((int64_t)1 << DIGIT_BITS) - 1)
#define SCALE_EXPONENT 298
#define BLOCK 1024
#define CARRY_BLOCKS 1024
#define PREFETCH_BLOCKS 2
#define EXPONENT_BITS 0x7f800000u

static void carry(int64_t *sums) {
    for (int digit = 0; digit < DIGITS - 1; digit++) {
        sums[digit + 1] += sums[digit] >> DIGIT_BITS;
        sums[digit] &= DIGIT_MASK;
    }
}

/* Adds total * 2^position (total < 2^(DIGIT_BITS + 10)) to the global digit sums. */
static void add_at(int64_t total, int position, int64_t *sums) {
    int digit = position / DIGIT_BITS, shift = position % DIGIT_BITS;
    int64_t rest = total >> (DIGIT_BITS - shift);
    int64_t parts[3] = {(total & ((DIGIT_MASK >> shift))) << shift, rest & DIGIT_MASK, rest >> DIGIT_BITS};
    for (int part = 0; part < 3; part++)
        if (parts[part]) sums[digit + part] += parts[part];
}

/* The bits of v + 2^52 for an integer 0 <= v < 2^52: v plus the bits of 2^52, so that integer sums,
 * which vectorize in any order, add such values exactly. */
static inline uint64_t offset_bits(double v) {
    double offset = v + 0x1p52;
    uint64_t bits;
    memcpy(&bits, &offset, sizeof bits);
    return bits;
}

/* The sum of the integers of BLOCK offset_bits added up (modulo 2^64). */
static int64_t offset_total(uint64_t sum) {
    uint64_t offset = offset_bits(0.0);
    return (int64_t)(sum - (uint64_t)BLOCK * offset);
}

/* t = x^2 * scale, exact (scale is a power of 2); 0 for a non-finite x where checked. */
static inline double scaled_square(uint32_t bits, double scale, int checked) {
    float value;
    memcpy(&value, &bits, sizeof value);
    double x = value;
    double square = x * x * scale;
    if (checked) square = (bits & EXPONENT_BITS) != EXPONENT_BITS ? square : 0.0;
    return square;
}

/* The two local digit sums of a block whose values span at most 2 DIGIT_BITS bits. */
static inline void add_two_digits(const uint32_t *bits, double scale, int checked, int base, int64_t *sums) {
    uint64_t low = 0, high = 0;
    for (int i = 0; i < BLOCK; i++) {
        double y = scaled_square(bits[i], scale, checked);
        double shifted = y + 0x1p52;
        uint64_t shifted_bits;
        memcpy(&shifted_bits, &shifted, sizeof shifted_bits);
        high += shifted_bits;
        double fraction = (y - (shifted - 0x1p52)) + 0x1.8p12;
        uint64_t fraction_bits;
        memcpy(&fraction_bits, &fraction, sizeof fraction_bits);
        low += fraction_bits;
    }
    double zero_high = 0x1p52, zero_low = 0x1.8p12;
    uint64_t zero_high_bits, zero_low_bits;
    memcpy(&zero_high_bits, &zero_high, sizeof zero_high_bits);
    memcpy(&zero_low_bits, &zero_low, sizeof zero_low_bits);
    int64_t low_total = (int64_t)(low - (uint64_t)BLOCK * zero_low_bits);
    int64_t high_total = (int64_t)(high - (uint64_t)BLOCK * zero_high_bits);
    int64_t borrow = low_total >> DIGIT_BITS;
    add_at(low_total - borrow * ((int64_t)1 << DIGIT_BITS), base, sums);
    add_at(high_total + borrow, base + DIGIT_BITS, sums);
}

/* Adds the digit sums of BLOCK float32 bit patterns to sums[0..DIGITS-1], their count of non-finite
 * values to sums[DIGITS] and of NaNs to sums[DIGITS + 1]. */
static void add_block(const uint32_t *bits, int64_t *sums) {
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
    if (top == 0) return;
    int highest = top >> 23 > 1 ? (int)(top >> 23) : 1;
    int lowest = (bottom + 1) >> 23 > 1 ? (int)((bottom + 1) >> 23) : 1;
    int base = 2 * lowest - 2;
    int local_digits = (2 * (highest - lowest) + 48 + DIGIT_BITS - 1) / DIGIT_BITS;
    double scale = ldexp(1.0, SCALE_EXPONENT - base);
    if (local_digits <= 2) {
        if (non_finite)
            add_two_digits(bits, scale / DIGIT_SCALE, 1, base, sums);
        else
            add_two_digits(bits, scale / DIGIT_SCALE, 0, base, sums);
        return;
    }
    double rests[BLOCK];
    for (int i = 0; i < BLOCK; i++) rests[i] = scaled_square(bits[i], scale, 1);
    for (int local = 0; local < local_digits; local++) {
        uint64_t sum = 0;
        for (int i = 0; i < BLOCK; i++) {
            double upper = floor(rests[i] / DIGIT_SCALE);
            sum += offset_bits(rests[i] - upper * DIGIT_SCALE);
            rests[i] = upper;
        }
        add_at(offset_total(sum), base + DIGIT_BITS * local, sums);
    }
}

/* Adds the digit sums and counts of count values to sums, read as float32 bit patterns from
 * values (16-bit ones widened by shifting them up 16 bits: bfloat16). */
static void add_values(const void *values, int width, int64_t count, int64_t *sums) {
    uint32_t block[BLOCK];
    int64_t blocks = 0;
    for (int64_t start = 0; start < count; start += BLOCK) {
        int64_t length = count - start < BLOCK ? count - start : BLOCK;
        const uint32_t *bits = (const uint32_t *)values + start;
        if (width == 2) {
            const uint16_t *narrow = (const uint16_t *)values + start;
            for (int64_t i = 0; i < length; i++) block[i] = (uint32_t)narrow[i] << 16;
            bits = block;
        } else if (length < BLOCK) {
            memcpy(block, bits, length * sizeof *block);
            bits = block;
        }
        if (length < BLOCK) memset(block + length, 0, (BLOCK - length) * sizeof *block);
        for (int line = 0; line < BLOCK * width; line += 64)
            __builtin_prefetch((const char *)values + (start + PREFETCH_BLOCKS * BLOCK) * width + line);
        add_block(bits, sums);
        if (++blocks % CARRY_BLOCKS == 0) carry(sums);
    }
    carry(sums);
}

void square_sum_float32(const uint32_t *bits, int64_t count, int64_t *sums) { add_values(bits, 4, count, sums); }

void square_sum_bfloat16(const uint16_t *bits, int64_t count, int64_t *sums) { add_values(bits, 2, count, sums); }
