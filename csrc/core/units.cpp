#include "units.h"

#include <cstdio>

namespace membudget {

std::string format_bytes(size_t bytes) {
  static const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%zu B", bytes);
  } else {
    std::snprintf(text, sizeof(text), "%.2f %s", value, kNames[unit]);
  }
  return text;
}

}  // namespace membudget
