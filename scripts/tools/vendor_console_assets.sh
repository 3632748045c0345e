#!/usr/bin/env bash
# Copies the console's two JavaScript libraries, built and minified, from the npm registry into
# app/console/static/, where they are committed and shipped in the package: the console loads nothing
# from a CDN and installing loraplex needs no Node. Run it (it needs npm) to move to another version,
# then commit the files it wrote.
set -euo pipefail

HTMX_VERSION=2.0.11   # htmx.org: forms and partial page updates
UPLOT_VERSION=1.6.32  # uPlot: the usage charts (about 50 KB, canvas, no dependencies)

static="$(cd "$(dirname "$0")/../.." && pwd)/app/console/static"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$work"
npm pack --silent "htmx.org@${HTMX_VERSION}" "uplot@${UPLOT_VERSION}" >/dev/null
tar -xzf "htmx.org-${HTMX_VERSION}.tgz" && mv package htmx
tar -xzf "uplot-${UPLOT_VERSION}.tgz" && mv package uplot

cp htmx/dist/htmx.min.js "$static/htmx.min.js"
cp uplot/dist/uPlot.iife.min.js "$static/uPlot.iife.min.js"
cp uplot/dist/uPlot.min.css "$static/uPlot.min.css"
cp htmx/LICENSE "$static/htmx.LICENSE"
cp uplot/LICENSE "$static/uPlot.LICENSE"
printf 'htmx.org %s\nuplot %s\n' "$HTMX_VERSION" "$UPLOT_VERSION" >"$static/VERSIONS"
echo "vendored htmx.org ${HTMX_VERSION} and uplot ${UPLOT_VERSION} into ${static}"
