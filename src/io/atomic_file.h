// Whole-file reads and crash-safe writes (temp file + fsync + rename), so a kill at any moment
// leaves either the old file or the new one, never a torn one.
#pragma once
#include <string>
#include <string_view>

namespace kvx::io {

std::string read_file(const std::string& path);  // throws kvx::Error naming the path
void write_file_atomic(const std::string& path, std::string_view bytes);
bool file_exists(const std::string& path);
void make_dirs(const std::string& path);
void fsync_dir(const std::string& dir);

// Before a long job writes into `dir`: creates it, checks that a file can be written there and
// that the file system has `bytes_needed` free; throws kvx::Error naming `what` and the fix.
void check_output_dir(const std::string& dir, double bytes_needed, const std::string& what);

}  // namespace kvx::io
