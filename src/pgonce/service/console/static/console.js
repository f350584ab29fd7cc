// Live counts on the console's overview: every 5 seconds, the figures marked data-live are read
// again from /admin/live (JSON, same origin, the browser's Basic credentials). No library, no
// inline script: the page's Content-Security-Policy allows scripts from pgonce only.
"use strict";
(function () {
  var fields = document.querySelectorAll("[data-live]");
  if (!fields.length) { return; }
  function refresh() {
    fetch("/admin/live", { credentials: "same-origin", cache: "no-store" })
      .then(function (response) { return response.ok ? response.json() : null; })
      .then(function (counts) {
        if (!counts) { return; }
        fields.forEach(function (field) {
          var value = counts[field.getAttribute("data-live")];
          if (value !== undefined) { field.textContent = String(value); }
        });
      })
      .catch(function () { /* the next tick tries again */ });
  }
  window.setInterval(refresh, 5000);
}());
