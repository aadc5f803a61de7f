// The CPU install path: our c10::Allocator in front of the runtime's device
// allocator, so that every torch CPU tensor made after install() is budgeted.
#pragma once

namespace membudget {

// Makes ours the CPU allocator (remembering the one it replaces). Idempotent.
void install_cpu_allocator();
// Puts the replaced allocator back. Memory already handed out by ours is
// still freed by ours: its DataPtrs carry our deleter.
void uninstall_cpu_allocator();
bool cpu_allocator_installed();

}  // namespace membudget
