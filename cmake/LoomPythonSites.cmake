# The site-packages folders of the first python3 on PATH (where Python-registry packages such as
# nvidia-cudnn-frontend and nvidia-cusparselt-cu13 put their headers and libraries), into `out`.
function(loom_python_site_packages out)
  set(_sites "")
  find_program(LOOM_PYTHON3 NAMES python3)
  if(LOOM_PYTHON3)
    execute_process(
      COMMAND ${LOOM_PYTHON3} -c
              "import site, sysconfig; p = sysconfig.get_paths(); print(';'.join([p['purelib'], p['platlib']] + site.getsitepackages() + [site.getusersitepackages()]))"
      OUTPUT_VARIABLE _sites OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(${out} "${_sites}" PARENT_SCOPE)
endfunction()
