/* Exact sums of squares of float32 and bfloat16 values on the CPU, in one pass over the data
 * (square_sum.py compiles this file at first use, and computes the same sums with torch operations
 * on other devices).
 *
 * A finite float32 x is s * 2^(e - 150) (s < 2^24, e its biased exponent, 1 for subnormals), so
 * u = x^2 * 2^298 = s^2 * 2^(2e - 2) is an integer below 2^556, exact in float64, whose bits lie
 * between 2^(2e - 2) and 2^(2e + 45). Its DIGIT_BITS-bit digit d is
 * floor(u / 2^(G d)) - 2^G floor(u / 2^(G (d + 1))) (G = DIGIT_BITS), exact in float64. A block of
 * BLOCK values visits only the digits its exponents reach: from its smallest nonzero value's lowest
 * possible bit to its largest value's highest. Its digit sums (below 2^50, exact in float64) are
 * added to int64 sums, which are carried every CARRY_BLOCKS blocks and at the end, so that every
 * digit sum but the last stays below 2^DIGIT_BITS between calls. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DIGITS 14
#define DIGIT_BITS 40
#define DIGIT_SCALE 0x1p40 /* 2^DIGIT_BITS */
#define SCALE_EXPONENT 298
#define BLOCK 1024
#define LANES 8
#define CARRY_BLOCKS 1024

static void carry(int64_t *sums) {
    for (int digit = 0; digit < DIGITS - 1; digit++) {
        sums[digit + 1] += sums[digit] >> DIGIT_BITS;
        sums[digit] &= ((int64_t)1 << DIGIT_BITS) - 1;
    }
}

/* Adds the digit sums of one block of float32 bit patterns to sums[0..DIGITS-1], its count of
 * non-finite values to sums[DIGITS] and of NaNs to sums[DIGITS + 1]. */
static void add_block(const uint32_t *bits, int64_t count, int64_t *sums) {
    /* The largest magnitude, and the smallest nonzero one less 1 (zeros wrap above every other). */
    uint32_t non_finite = 0, nans = 0, top = 0, bottom = 0xffffffffu;
    for (int64_t i = 0; i < count; i++) {
        uint32_t magnitude = bits[i] & 0x7fffffffu;
        non_finite += magnitude >= 0x7f800000u;
        nans += magnitude > 0x7f800000u;
        top = magnitude > top ? magnitude : top;
        bottom = magnitude - 1 < bottom ? magnitude - 1 : bottom;
    }
    sums[DIGITS] += non_finite;
    sums[DIGITS + 1] += nans;
    if (non_finite) {
        top = 0;
        bottom = 0xffffffffu;
        for (int64_t i = 0; i < count; i++) {
            uint32_t magnitude = bits[i] & 0x7fffffffu;
            if (magnitude >= 0x7f800000u) continue;
            top = magnitude > top ? magnitude : top;
            bottom = magnitude - 1 < bottom ? magnitude - 1 : bottom;
        }
    }
    if (top == 0) return;
    int highest = top >> 23 > 1 ? (int)(top >> 23) : 1;
    int lowest = (bottom + 1) >> 23 > 1 ? (int)((bottom + 1) >> 23) : 1;
    int first = (2 * lowest - 2) / DIGIT_BITS;
    int last = (2 * highest + 45) / DIGIT_BITS;

    /* u / 2^(G first): an integer, since no bit of the block lies below 2^(G first). */
    double digits[BLOCK];
    double scale = ldexp(1.0, SCALE_EXPONENT - DIGIT_BITS * first);
    for (int64_t i = 0; i < count; i++) {
        float value;
        memcpy(&value, &bits[i], sizeof value);
        double x = value;
        digits[i] = (bits[i] & 0x7f800000u) != 0x7f800000u ? x * x * scale : 0.0;
    }
    int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t i = count; i < padded; i++) digits[i] = 0.0;

    /* digits[i] holds floor(u / 2^(G digit)); its low G bits are digit `digit` of u. */
    for (int digit = first; digit <= last; digit++) {
        double lanes[LANES] = {0.0};
        for (int64_t i = 0; i < padded; i += LANES) {
            for (int lane = 0; lane < LANES; lane++) {
                double upper = floor(digits[i + lane] / DIGIT_SCALE);
                lanes[lane] += digits[i + lane] - upper * DIGIT_SCALE;
                digits[i + lane] = upper;
            }
        }
        double total = 0.0;
        for (int lane = 0; lane < LANES; lane++) total += lanes[lane];
        sums[digit] += (int64_t)total;
    }
}

void square_sum_float32(const uint32_t *bits, int64_t count, int64_t *sums) {
    int64_t blocks = 0;
    for (int64_t start = 0; start < count; start += BLOCK) {
        add_block(bits + start, count - start < BLOCK ? count - start : BLOCK, sums);
        if (++blocks % CARRY_BLOCKS == 0) carry(sums);
    }
    carry(sums);
}

void square_sum_bfloat16(const uint16_t *bits, int64_t count, int64_t *sums) {
    uint32_t widened[BLOCK];
    int64_t blocks = 0;
    for (int64_t start = 0; start < count; start += BLOCK) {
        int64_t block = count - start < BLOCK ? count - start : BLOCK;
        for (int64_t i = 0; i < block; i++) widened[i] = (uint32_t)bits[start + i] << 16;
        add_block(widened, block, sums);
        if (++blocks % CARRY_BLOCKS == 0) carry(sums);
    }
    carry(sums);
}
