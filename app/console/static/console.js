// The console's script: usage charts (uPlot), the adapter drop zone, and focus after page swaps.
// Pages work without it but for the charts and uploads; it runs no inline code (the CSP forbids it).
(function () {
  "use strict";

  var DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3], [1, 6], [12, 6]];
  var STROKES = ["#0550ae", "#a40e26", "#116329", "#8250df", "#953800", "#1b1f24"];

  function csrfToken() {
    var meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.getAttribute("content") : "";
  }

  function series(label, index) {
    // Each line differs by dash pattern as well as colour, so the charts read without colour.
    return { label: label, stroke: STROKES[index % STROKES.length], dash: DASHES[index % DASHES.length], width: 2 };
  }

  function drawChart(box, days, lines) {
    if (!box || !window.uPlot) return;
    box.textContent = "";
    var xs = days.map(function (day) { return Date.parse(day + "T00:00:00Z") / 1000; });
    var width = Math.max(box.clientWidth, 280);
    var opts = {
      width: width,
      height: 220,
      series: [{ label: "Day" }].concat(lines.map(function (line, i) { return series(line.label, i); })),
      axes: [{}, { size: 70 }],
      scales: { x: { time: true } },
    };
    new window.uPlot(opts, [xs].concat(lines.map(function (line) { return line.values; })), box);
  }

  function drawUsage() {
    var source = document.getElementById("usage-chart-data");
    if (!source) return;
    var data = JSON.parse(source.textContent);
    drawChart(document.getElementById("tokens-chart"), data.days, [
      { label: "Tokens in (prompt)", values: data.prompt_tokens },
      { label: "Tokens out (completion)", values: data.completion_tokens },
    ]);
    var requestLines = Object.keys(data.requests).map(function (name) {
      return { label: name, values: data.requests[name] };
    });
    drawChart(document.getElementById("requests-chart"), data.days, requestLines);
  }

  function listChosen(form, files) {
    var list = form.querySelector(".chosen");
    list.textContent = "";
    Array.prototype.forEach.call(files, function (file) {
      var item = document.createElement("li");
      item.textContent = file.name + " (" + file.size + " bytes)";
      list.appendChild(item);
    });
  }

  function setupUpload() {
    var form = document.getElementById("upload");
    if (!form || form.dataset.ready) return;
    form.dataset.ready = "1";
    var drop = form.querySelector(".drop");
    var input = form.querySelector('input[type="file"]');
    var result = form.querySelector(".upload-result");
    var dropped = null;
    input.addEventListener("change", function () { dropped = null; listChosen(form, input.files); });
    ["dragenter", "dragover"].forEach(function (name) {
      drop.addEventListener(name, function (event) { event.preventDefault(); drop.classList.add("over"); });
    });
    ["dragleave", "drop"].forEach(function (name) {
      drop.addEventListener(name, function () { drop.classList.remove("over"); });
    });
    drop.addEventListener("drop", function (event) {
      event.preventDefault();
      dropped = event.dataTransfer.files;
      listChosen(form, dropped);
    });
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      var files = dropped || input.files;
      var body = new FormData();
      body.append("name", form.querySelector('input[name="name"]').value.trim());
      if (form.querySelector('input[name="replace"]').checked) body.append("replace", "true");
      // Each file goes in the part named after it; the server names any file it does not expect.
      Array.prototype.forEach.call(files, function (file) { body.append(file.name, file, file.name); });
      result.className = "upload-result";
      result.textContent = "Uploading and validating…";
      fetch(form.dataset.action, {
        method: "POST",
        body: body,
        headers: { "X-CSRF-Token": csrfToken() },
        credentials: "same-origin",
      }).then(function (response) {
        return response.text().then(function (text) {
          if (response.ok) { window.location.reload(); return; }
          result.className = "upload-result error";
          result.textContent = "Upload refused: " + text;
        });
      }).catch(function (error) {
        result.className = "upload-result error";
        result.textContent = "The upload did not reach the server: " + error.message;
      });
    });
  }

  function setup() {
    drawUsage();
    setupUpload();
  }

  document.addEventListener("DOMContentLoaded", setup);
  document.addEventListener("htmx:afterSettle", function () {
    setup();
    var main = document.getElementById("main");
    if (main) main.focus();
  });
})();
