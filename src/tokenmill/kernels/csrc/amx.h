// AMX tiles, shared by the kernels that use them (panel_linear.cpp, w8a8.cpp):
// the tile configuration's layout and the process's permission to use the tile state.
#pragma once

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <cstdint>

namespace tm_cpu {

// ldtilecfg's 64-byte operand (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a tile configuration. (The barrier: GCC does not see ldtilecfg read its operand and may drop
// the stores that filled it in, leaving every tile unconfigured: tile instructions then fault.)
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Linux hands a process the tile state only when asked (arch_prctl); asked once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace tm_cpu
#endif
