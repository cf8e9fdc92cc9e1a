# Finds Kokkos and repairs a known packaging defect: Debian's Trilinos build exports Kokkos::kokkos
# with an include directory computed from the wrong prefix (e.g. /usr/lib/include, which does not
# exist) while the headers live in /usr/include/trilinos. Installed with loom so that consumers get
# the same repair.
macro(loom_find_kokkos)
  if(NOT TARGET Kokkos::kokkos)
    find_package(Kokkos ${ARGN})
  endif()
  if(TARGET Kokkos::kokkos)
    get_target_property(_loom_kk_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
    set(_loom_kk_hints "")
    foreach(_d IN LISTS _loom_kk_inc)
      list(APPEND _loom_kk_hints "${_d}" "${_d}/trilinos")
    endforeach()
    find_path(LOOM_KOKKOS_INCLUDE_DIR Kokkos_Core.hpp HINTS ${_loom_kk_hints} PATH_SUFFIXES trilinos kokkos)
    if(NOT LOOM_KOKKOS_INCLUDE_DIR)
      message(FATAL_ERROR "loom: Kokkos was found but Kokkos_Core.hpp is not under ${_loom_kk_inc} nor the "
                          "standard include paths (set LOOM_KOKKOS_INCLUDE_DIR)")
    endif()
    # Keep the directories that exist and add the one that holds the headers.
    set(_loom_kk_fixed "${LOOM_KOKKOS_INCLUDE_DIR}")
    foreach(_d IN LISTS _loom_kk_inc)
      if(EXISTS "${_d}" AND NOT _d STREQUAL LOOM_KOKKOS_INCLUDE_DIR)
        list(APPEND _loom_kk_fixed "${_d}")
      endif()
    endforeach()
    set_target_properties(Kokkos::kokkos PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_loom_kk_fixed}")
  endif()
endmacro()
