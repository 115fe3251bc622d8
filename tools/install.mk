# make install / make uninstall (issue 17). Included by the Makefile.
#
#   make install [PREFIX=/usr/local] [DESTDIR=/tmp/stage]
#
# installs, under $(DESTDIR):
#   $(LIBDIR)/libhakmem.so.X.Y.Z (soname libhakmem.so.X), libhakmem.so.X and
#     libhakmem.so (the development link), libhakmem.a
#   $(INCLUDEDIR)/hakmem.h (+ hakmem_counters.h, hakmem_knobs.h)
#   $(PKGCONFIGDIR)/hakmem.pc          pkg-config --cflags --libs hakmem
#   $(HK_VENV)                         a virtual environment holding the hakmem
#     Python package (a wheel built from this checkout) and its dependencies;
#     $(BINDIR)/hakmem and hakmem-learnd link to its console scripts
#   $(UNITDIR)/hakmem-learnd.service, $(TMPFILESDIR)/hakmem.conf
#   $(DATADIR)/hakmem/: preload.conf (the drop-in), learnd.toml (example)
#   $(SYSCONFDIR)/hakmem/learnd.toml   only when there is none (never overwritten)
#
# HK_PY_DEPS_FROM=DIR: take the Python dependencies from the site-packages
# DIR (a .pth line) instead of downloading them: offline machines, and the
# test that installs into a temporary DESTDIR.
PREFIX       ?= /usr/local
BINDIR       ?= $(PREFIX)/bin
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
DATADIR      ?= $(PREFIX)/share
DOCDIR       ?= $(DATADIR)/doc/hakmem
SYSCONFDIR   ?= /etc
HK_VENV      ?= $(LIBDIR)/hakmem/venv
# systemd reads /usr/lib for the distribution's units, /etc for the admin's.
UNITDIR      ?= $(if $(filter /usr,$(PREFIX)),/usr/lib/systemd/system,/etc/systemd/system)
TMPFILESDIR  ?= $(if $(filter /usr,$(PREFIX)),/usr/lib/tmpfiles.d,/etc/tmpfiles.d)
HK_PY_DEPS_FROM ?=

# The release, one source of truth: schemas/shm_layout.json's hakmem_version.
HK_VERSION := $(shell sed -n 's/^ *"hakmem_version": *"\([^"]*\)".*/\1/p' schemas/shm_layout.json)
HK_MAJOR   := $(firstword $(subst ., ,$(HK_VERSION)))
HK_SONAME  := libhakmem.so.$(HK_MAJOR)

D := $(DESTDIR)
HK_SUBST = sed -e 's|@HK_VENV@|$(HK_VENV)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
  -e 's|@HK_MAJOR@|$(HK_MAJOR)|g' -e 's|@HK_VERSION@|$(HK_VERSION)|g' -e 's|@PREFIX@|$(PREFIX)|g' \
  -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|/usr/local/share/doc/hakmem|$(DOCDIR)|g'

.PHONY: install install-lib install-python install-systemd uninstall

install: install-lib install-python install-systemd ## install library, header, hakmem.pc, the Python package in a venv, systemd files (PREFIX=/usr/local DESTDIR=)
	@echo "installed hakmem $(HK_VERSION) under $(D)$(PREFIX)$(if $(D),, (run: ldconfig; systemd-tmpfiles --create; systemctl daemon-reload))"

install-lib: lib
	$(Q)install -d $(D)$(LIBDIR) $(D)$(INCLUDEDIR) $(D)$(PKGCONFIGDIR) $(D)$(DOCDIR)
	$(Q)install -m 0755 $(BUILD)/libhakmem.so $(D)$(LIBDIR)/libhakmem.so.$(HK_VERSION)
	$(Q)ln -sfn libhakmem.so.$(HK_VERSION) $(D)$(LIBDIR)/$(HK_SONAME)
	$(Q)ln -sfn $(HK_SONAME) $(D)$(LIBDIR)/libhakmem.so
	$(Q)install -m 0644 $(BUILD)/libhakmem.a $(D)$(LIBDIR)/libhakmem.a
	$(Q)install -m 0644 $(INC_DIR)/hakmem.h $(INC_DIR)/hakmem_counters.h $(INC_DIR)/hakmem_knobs.h $(D)$(INCLUDEDIR)/
	$(Q)$(HK_SUBST) deploy/hakmem.pc.in > $(D)$(PKGCONFIGDIR)/hakmem.pc && chmod 0644 $(D)$(PKGCONFIGDIR)/hakmem.pc
	$(Q)install -m 0644 README.md $(D)$(DOCDIR)/README.md

# The wheel is built from a copy of what the package is made of (setuptools
# would otherwise write build/lib and *.egg-info into the checkout).
install-python: venv
	$(Q)rm -rf $(BUILD)/pysrc $(BUILD)/wheel && mkdir -p $(BUILD)/pysrc $(BUILD)/wheel
	$(Q)tar -cf - --exclude=__pycache__ --exclude='*.egg-info' --exclude=_pb pyproject.toml setup.py proto \
	  schemas/sql schemas/fleet learner/hakmem | tar -xf - -C $(BUILD)/pysrc
	@$(if $(Q),echo "  WHEEL   $(BUILD)/wheel")
	$(Q)$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation --no-index \
	  -w $(BUILD)/wheel $(BUILD)/pysrc
	@$(if $(Q),echo "  VENV    $(D)$(HK_VENV)")
	$(Q)rm -rf $(D)$(HK_VENV) && $(PYTHON3) -m venv --without-pip $(D)$(HK_VENV)
	$(Q)$(if $(HK_PY_DEPS_FROM),echo '$(abspath $(HK_PY_DEPS_FROM))' > \
	  "$$($(D)$(HK_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hakmem-deps.pth")
	$(Q)$(PY) -m pip --python $(D)$(HK_VENV)/bin/python install -q --disable-pip-version-check \
	  $(if $(HK_PY_DEPS_FROM),--no-index) "$$(ls $(BUILD)/wheel/hakmem-*.whl)[fleet]"
	$(Q)$(if $(D),grep -rlI --null -e '$(D)' $(D)$(HK_VENV)/bin $(D)$(HK_VENV)/pyvenv.cfg | \
	  xargs -0 -r sed -i 's|$(D)||g')
	$(Q)install -d $(D)$(BINDIR)
	$(Q)ln -sfn $(HK_VENV)/bin/hakmem $(D)$(BINDIR)/hakmem
	$(Q)ln -sfn $(HK_VENV)/bin/hakmem-learnd $(D)$(BINDIR)/hakmem-learnd

install-systemd:
	$(Q)install -d $(D)$(UNITDIR) $(D)$(TMPFILESDIR) $(D)$(DATADIR)/hakmem $(D)$(SYSCONFDIR)/hakmem
	$(Q)$(HK_SUBST) deploy/hakmem-learnd.service > $(D)$(UNITDIR)/hakmem-learnd.service
	$(Q)chmod 0644 $(D)$(UNITDIR)/hakmem-learnd.service
	$(Q)install -m 0644 deploy/hakmem.tmpfiles $(D)$(TMPFILESDIR)/hakmem.conf
	$(Q)$(HK_SUBST) deploy/preload.conf > $(D)$(DATADIR)/hakmem/preload.conf
	$(Q)install -m 0644 deploy/learnd.toml $(D)$(DATADIR)/hakmem/learnd.toml
	$(Q)test -e $(D)$(SYSCONFDIR)/hakmem/learnd.toml || install -m 0644 deploy/learnd.toml $(D)$(SYSCONFDIR)/hakmem/learnd.toml

# What install made, except $(SYSCONFDIR)/hakmem/learnd.toml (the admin's)
# and the data learnd keeps (/var/lib/hakmem: README "Where the data lives").
uninstall: ## remove what `make install` installed (same PREFIX/DESTDIR); keeps /etc/hakmem and /var/lib/hakmem
	$(Q)rm -f $(D)$(LIBDIR)/libhakmem.so.$(HK_VERSION) $(D)$(LIBDIR)/$(HK_SONAME) $(D)$(LIBDIR)/libhakmem.so \
	  $(D)$(LIBDIR)/libhakmem.a $(D)$(INCLUDEDIR)/hakmem.h $(D)$(INCLUDEDIR)/hakmem_counters.h \
	  $(D)$(INCLUDEDIR)/hakmem_knobs.h $(D)$(PKGCONFIGDIR)/hakmem.pc $(D)$(BINDIR)/hakmem $(D)$(BINDIR)/hakmem-learnd \
	  $(D)$(UNITDIR)/hakmem-learnd.service $(D)$(TMPFILESDIR)/hakmem.conf $(D)$(DATADIR)/hakmem/preload.conf \
	  $(D)$(DATADIR)/hakmem/learnd.toml $(D)$(DOCDIR)/README.md
	$(Q)rm -rf $(D)$(HK_VENV)
	$(Q)rmdir $(D)$(LIBDIR)/hakmem $(D)$(DATADIR)/hakmem $(D)$(DOCDIR) 2>/dev/null || true
	@echo "uninstalled hakmem from $(D)$(PREFIX) ($(SYSCONFDIR)/hakmem and /var/lib/hakmem kept)"
