# CMake toolchain file: cross-compile Lever's native kernels for aarch64 Linux with zig-cc
# (beside this file), so CMakeLists.txt takes its arm64 branch (NEON sources, LEVER_HAVE_NEON).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER ${CMAKE_CURRENT_LIST_DIR}/zig-cc)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
